"""What the transformers engine loads at start, shared by the backend and its request runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Loaded:
    """Everything start() loads; the scheduler thread owns `model`."""

    tokenizer: Any
    scheduler: Any
    compiler: Any
    eos_token_ids: frozenset[int]
    vocab_size: int
    context_length: int
