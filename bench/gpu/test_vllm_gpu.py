"""vLLM engine on a real GPU, through the whole local path: placement (NVML) → worker → AsyncLLM.

Run by bench/gpu/check.sh on a GPU machine: pytest -m gpu bench/gpu/test_vllm_gpu.py
Needs $GENGATE_VLLM_MODEL (an HF folder; check.sh builds a small random Llama).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator

import jsonschema
import pytest
from gengate.backend import collect_stream
from gengate.config import parse_config
from gengate.domain import (
    ChoiceConstraint,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
    StoppingCriteria,
    StreamStart,
    StructuredOutput,
)
from gengate.workers.backend import WorkerBackend
from gengate.workers.factory import build_backend

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="session")
async def vllm() -> AsyncIterator[WorkerBackend]:
    model = os.environ.get("GENGATE_VLLM_MODEL")
    if not model:
        pytest.skip("GENGATE_VLLM_MODEL is not set")
    entry = {
        "name": "small",
        "backend": "vllm",
        "model": model,
        "max_model_len": 1024,
        "gpu_memory_utilization": 0.3,
        "enforce_eager": True,
    }
    backend = build_backend(parse_config({"models": [entry]}).models[0])
    assert isinstance(backend, WorkerBackend)
    await backend.start()
    yield backend
    await backend.aclose()


def req(**kwargs: object) -> GenerationRequest:
    base: dict[str, object] = {
        "model": "small",
        "prompt": "Hello",
        "sampling": SamplingParams(temperature=1.0, seed=7),
        "stopping": StoppingCriteria(max_tokens=64),
    }
    base.update(kwargs)
    return GenerationRequest(**base)  # type: ignore[arg-type]


async def test_placement_and_capabilities(vllm: WorkerBackend) -> None:
    assert vllm.lease is not None and len(vllm.lease.devices) == 1
    assert vllm.capabilities.context_length == 1024 and vllm.capabilities.max_n >= 2


async def test_text(vllm: WorkerBackend) -> None:
    result = await vllm.generate(req())
    (gen,) = result.generations
    assert gen.text and gen.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert result.usage.input_tokens > 0 and result.usage.output_tokens == gen.output_tokens > 0


async def test_stream(vllm: WorkerBackend) -> None:
    events = [e async for e in vllm.generate_stream(req(stopping=StoppingCriteria(max_tokens=32)))]
    assert isinstance(events[0], StreamStart) and isinstance(events[-1], GenerationEnd)
    deltas = [e for e in events if isinstance(e, GenerationDelta)]
    assert len(deltas) > 1
    assert sum(d.token_count for d in deltas) == events[-1].usage.output_tokens


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (JsonSchemaConstraint(SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        (
            RegexConstraint(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
            lambda t: re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", t),
        ),
        (ChoiceConstraint(("red", "green", "blue")), lambda t: t in ("red", "green", "blue")),
        (
            GrammarConstraint(GrammarSyntax.LARK, 'start: "ab" NUM\nNUM: /[0-9]{1,3}/'),
            lambda t: re.fullmatch(r"ab[0-9]{1,3}", t),
        ),
        (JsonObjectConstraint(), lambda t: isinstance(json.loads(t), dict)),
    ],
    ids=["json_schema", "regex", "choice", "grammar", "json_object"],
)
async def test_each_constraint_kind(vllm: WorkerBackend, constraint: object, check: object) -> None:
    result = await vllm.generate(
        req(structured_output=StructuredOutput(constraint), stopping=StoppingCriteria(max_tokens=200))  # type: ignore[arg-type]
    )
    assert result.enforcement is Enforcement.ENGINE
    gen = result.generations[0]
    assert gen.finish_reason is FinishReason.STOP, gen
    assert check(gen.text), gen.text  # type: ignore[operator]


async def test_n_2_with_seed_is_reproducible(vllm: WorkerBackend) -> None:
    first = await vllm.generate(req(n=2))
    again = await vllm.generate(req(n=2))
    assert [g.index for g in first.generations] == [0, 1]
    assert [g.text for g in first.generations] == [g.text for g in again.generations]


async def test_cancel_aborts_the_engine_request(vllm: WorkerBackend) -> None:
    stream = vllm.generate_stream(req(stopping=StoppingCriteria(max_tokens=900)))
    async for event in stream:
        if isinstance(event, GenerationDelta):
            break
    await stream.aclose()
    assert vllm.in_flight == 0 and await vllm.worker_in_flight() == 0


async def test_concurrent_requests_are_batched(vllm: WorkerBackend) -> None:
    results = await asyncio.gather(
        *(collect_stream(vllm.generate_stream(req(prompt=f"n{i}"))) for i in range(32))
    )
    assert all(r.generations[0].output_tokens > 0 for r in results)
