"""Seeded constrained generations, token for token, on the llama.cpp and transformers tiny models.

The ids in constrained_pins.json were recorded from the decoder on 2026-12-02 (82e0235); the
temperature draws without a cut (temperature 1, penalties) were re-recorded on 2026-12-03, when
the decoder began drawing before it masks (same distribution, other random numbers; greedy and
the cut samplings kept their ids). A change to how the mask is computed or how the sampler reads
it must never change which token a seed picks. Run these around any change to
engines/decoding.py or the engines' mask handling.
Re-record only for a deliberate change of sampling semantics:

    GENGATE_RECORD_PINS=1 .venv/bin/python -m pytest -m slow tests/engines/test_constrained_pins.py

Marked slow, outside the default run: the fixture holds one machine's floating point (the
llama.cpp wheel is built for the CPU it is built on, torch dispatches by CPU), and another CPU
may round a logit differently and pick another token with no bug anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from gengate.domain import (
    ChoiceConstraint,
    Constraint,
    FinishReason,
    GenerationRequest,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
)
from gengate.models.tiny import TinyModelPaths

pytestmark = pytest.mark.slow

PINS = Path(__file__).with_name("constrained_pins.json")
RECORD = os.environ.get("GENGATE_RECORD_PINS") == "1"
PROMPT = "Hello world, the answer is"
SEEDS = (1, 2)
MAX_TOKENS = 24

CONSTRAINTS: dict[str, Constraint] = {
    "json_schema": JsonSchemaConstraint(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        }
    ),
    "regex": RegexConstraint(r"[A-Z][a-z]{2,6} [0-9]{1,3}(\.[0-9])?"),
    "choice": ChoiceConstraint(("positive", "negative", "neutral")),
}

# Every sampling knob the decoder applies before it draws among the allowed ids.
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.8 top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "top_k 5 min_p 0.05": {"temperature": 1.3, "top_k": 5, "min_p": 0.05},
    "penalties": {
        "temperature": 0.9,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
    },
}

CASES = [(c, s) for c in CONSTRAINTS for s in SAMPLINGS]


def _llamacpp(tiny_model: TinyModelPaths, **options: Any) -> Any:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (extra: llamacpp)")
    from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions

    return LlamaCppBackend(
        "tiny", LlamaCppOptions(path=str(tiny_model.gguf_path), n_ctx=512, n_threads=1, **options)
    )


def _transformers(tiny_model: TinyModelPaths, **options: Any) -> Any:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gengate.engines.transformers import TransformersBackend, TransformersOptions

    return TransformersBackend("tiny", TransformersOptions(model=str(tiny_model.hf_dir), **options))


ENGINES = {"llamacpp": _llamacpp, "transformers": _transformers}


def engine_settings() -> list[dict[str, Any]]:
    """The engine options the pins must hold under (each mask_overlap mode once it exists)."""
    return [{}]


@pytest.fixture(
    scope="module", params=[(e, i) for e in ENGINES for i in range(len(engine_settings()))], ids=str
)
async def engine(
    request: pytest.FixtureRequest, tiny_model: TinyModelPaths
) -> AsyncIterator[tuple[str, Any]]:
    name, which = request.param
    backend = ENGINES[name](tiny_model, **engine_settings()[which])
    await backend.start()
    yield name, backend
    await backend.aclose()


def _pins() -> dict[str, dict[str, list[list[int]]]]:
    return json.loads(PINS.read_text()) if PINS.exists() else {}


async def _ids(backend: Any, constraint: str, sampling: str, seed: int) -> tuple[list[int], FinishReason]:
    request = GenerationRequest(
        model="tiny",
        prompt=PROMPT,
        sampling=SamplingParams(seed=seed, **SAMPLINGS[sampling]),
        stopping=StoppingCriteria(max_tokens=MAX_TOKENS),
        structured_output=StructuredOutput(CONSTRAINTS[constraint]),
        logprobs=0,
    )
    gen = (await backend.generate(request)).generations[0]
    assert gen.logprobs is not None
    return [lp.token_id for lp in gen.logprobs], gen.finish_reason


@pytest.mark.parametrize(("constraint", "sampling"), CASES)
async def test_seeded_constrained_token_ids_are_pinned(
    engine: tuple[str, Any], constraint: str, sampling: str
) -> None:
    name, backend = engine
    key = f"{constraint} / {sampling}"
    got = [await _ids(backend, constraint, sampling, seed) for seed in SEEDS]
    if RECORD:
        pins = _pins()
        pins.setdefault(name, {})[key] = [ids for ids, _ in got]
        PINS.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
        return
    assert [ids for ids, _ in got] == _pins()[name][key], key


def test_the_pins_cover_complete_outputs() -> None:
    """Not all pinned runs are cut by max_tokens: the end-of-grammar path is pinned too."""
    pins = _pins()
    for name in ENGINES:
        if name not in pins:
            continue
        lengths = [len(ids) for runs in pins[name].values() for ids in runs]
        assert len(lengths) == len(CASES) * len(SEEDS)
        assert any(n < MAX_TOKENS for n in lengths), name
