"""The backend options every local engine takes (GenerateRequest.backend_options).

`min_tokens` and `ignore_eos` are what vLLM's own server offers beyond the common sampling
fields; llama.cpp and transformers honour them in the shared SequenceDecoder, vLLM natively.
Both keep the end-of-sequence token (and stop strings, as vLLM does) from ending a generation,
so neither goes with a structured output, whose grammar decides where the text ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gengate import errors
from gengate.domain import GenerationRequest

# option name -> the type its value must have
ENGINE_OPTION_TYPES: dict[str, type] = {"min_tokens": int, "ignore_eos": bool}
ENGINE_OPTIONS = frozenset(ENGINE_OPTION_TYPES)


@dataclass(frozen=True)
class EngineOptions:
    """A request's engine options, checked."""

    min_tokens: int = 0  # no end (EOS or stop string) before this many tokens
    ignore_eos: bool = False  # generate until max_tokens or a stop string

    @property
    def holds_eos(self) -> bool:
        return self.ignore_eos or self.min_tokens > 0


NO_OPTIONS = EngineOptions()


def engine_options(request: GenerationRequest, *, also: frozenset[str] = frozenset()) -> EngineOptions:
    """The request's engine options, or InvalidArgument naming `backend_options[key]`. Keys in
    `also` are the engine's own (vLLM's `lora`), checked by it."""
    given = request.backend_options
    if not given:
        return NO_OPTIONS
    for key, value in given.items():
        if key in also:
            continue
        expected = ENGINE_OPTION_TYPES.get(key)
        if expected is None:  # the service refuses unknown keys before an engine sees them
            raise errors.InvalidArgument.field(f"backend_options[{key}]", "unknown option")
        if type(value) is not expected:  # bool is an int subclass: compare exactly
            raise errors.InvalidArgument.field(
                f"backend_options[{key}]", f"must be a {expected.__name__}, got {type(value).__name__}"
            )
    min_tokens = int(given.get("min_tokens", 0))
    if min_tokens < 0:
        raise errors.InvalidArgument.field("backend_options[min_tokens]", "must be 0 or more")
    max_tokens = request.stopping.max_tokens
    if max_tokens is not None and min_tokens > max_tokens:
        raise errors.InvalidArgument.field(
            "backend_options[min_tokens]", f"is {min_tokens}, more than stopping.max_tokens ({max_tokens})"
        )
    options = EngineOptions(min_tokens=min_tokens, ignore_eos=bool(given.get("ignore_eos", False)))
    if options.holds_eos and request.structured_output is not None:
        key = "ignore_eos" if options.ignore_eos else "min_tokens"
        raise errors.InvalidArgument.field(
            f"backend_options[{key}]", "does not go with structured_output (its grammar decides the end)"
        )
    return options


def refuse_own_keys(value: dict[str, Any], own: Mapping[str, str]) -> dict[str, Any]:
    """A pass-through mapping of engine arguments, refused (ValueError naming each) where it sets
    one that gengate sets itself from the option `own[key]`."""
    taken = sorted(set(value) & set(own))
    if taken:
        raise ValueError("; ".join(f"{key!r} is set by gengate from `{own[key]}`" for key in taken))
    return value
