"""llguidance tokenizers for the engines' tokenizers, built once per tokenizer object.

Building one walks the whole vocabulary (~1-2 s for large vocabularies), so each is cached for
the life of the tokenizer object it was made from.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

from llguidance import LLTokenizer

_lock = threading.Lock()
# id(source) -> (source, value); the source is kept alive so its id is never reused.
_cache: dict[int, tuple[object, LLTokenizer]] = {}
_longest: dict[int, tuple[object, int]] = {}
T = TypeVar("T")


def _cached(source: object, build: Callable[[], T], cache: dict[int, tuple[object, T]] | None = None) -> T:
    """`build()`, made once per `source` object (in `cache`, by default the tokenizers')."""
    store: dict[int, tuple[object, Any]] = _cache if cache is None else cache
    with _lock:
        hit = store.get(id(source))
        if hit is not None and hit[0] is source:
            return cast(T, hit[1])
    built = build()
    with _lock:
        store[id(source)] = (source, built)
    return built


def make_ll_tokenizer_from_hf(tokenizer: Any, *, n_vocab: int | None = None) -> LLTokenizer:
    """llguidance tokenizer for a Hugging Face fast tokenizer (cached per tokenizer object)."""

    def build() -> LLTokenizer:
        from llguidance.hf import from_tokenizer

        return from_tokenizer(tokenizer, n_vocab=n_vocab)

    return _cached(tokenizer, build)


def make_ll_tokenizer_from_llama(llama: Any) -> LLTokenizer:
    """llguidance tokenizer for a `llama_cpp.Llama` model (cached per model object)."""

    def build() -> LLTokenizer:
        import llama_cpp
        from llguidance.llamacpp import lltokenizer_from_vocab

        vocab = llama_cpp.llama_model_get_vocab(llama.model)
        with warnings.catch_warnings():
            # llguidance calls a llama.cpp function deprecated in favour of a vocab one, per token
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(vocab)

    return _cached(llama, build)


def longest_token_bytes(tokenizer: LLTokenizer) -> int:
    """The most bytes one token of `tokenizer` spells (cached per tokenizer object: one pass over
    the vocabulary, ~50 ms at 128k)."""

    def build() -> int:
        return max((len(tokenizer.decode_bytes([t])) for t in range(tokenizer.vocab_size)), default=0)

    return _cached(tokenizer, build, _longest)
