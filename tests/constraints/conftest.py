"""Fixtures for constraint tests: the tiny model's real tokenizer, as tokenizers and llguidance see it."""

from __future__ import annotations

from typing import Any

import pytest
from gengate.models.tiny import EOS_TOKEN, TinyModelPaths
from llguidance import LLTokenizer
from tokenizers import Tokenizer


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model: TinyModelPaths) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model.hf_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def eos_id(hf_tokenizer: Tokenizer) -> int:
    token_id: Any = hf_tokenizer.token_to_id(EOS_TOKEN)
    assert isinstance(token_id, int)
    return token_id


@pytest.fixture(scope="session")
def ll_tokenizer(hf_tokenizer: Tokenizer, eos_id: int) -> LLTokenizer:
    return LLTokenizer(hf_tokenizer.to_str(), eos_token=eos_id)
