"""llguidance tokenizers made from the engines' own tokenizer objects, cached per object."""

from __future__ import annotations

import pytest
from gengate.constraints import make_ll_tokenizer_from_hf, make_ll_tokenizer_from_llama
from gengate.models.tiny import TinyModelPaths

pytestmark = pytest.mark.timeout(120)


def test_from_hf_tokenizer_is_cached_and_agrees(tiny_model: TinyModelPaths) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_model.hf_dir))
    ll = make_ll_tokenizer_from_hf(hf)
    assert make_ll_tokenizer_from_hf(hf) is ll
    assert ll.eos_token == hf.eos_token_id
    text = '{"name": "Ada", "age": 36}'
    assert ll.tokenize_str(text) == hf.encode(text, add_special_tokens=False)


def test_from_llama_is_cached_and_agrees(tiny_model: TinyModelPaths) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(tiny_model.gguf_path), n_ctx=64, verbose=False)
    try:
        ll = make_ll_tokenizer_from_llama(llm)
        assert make_ll_tokenizer_from_llama(llm) is ll
        assert ll.vocab_size == llm.n_vocab()
        text = '{"name": "Ada", "age": 36}'
        assert ll.tokenize_str(text) == llm.tokenize(text.encode(), add_bos=False)
    finally:
        llm.close()
