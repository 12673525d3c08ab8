"""Real engines in worker processes on the tiny model: llama.cpp, transformers and MLX.

kill -9 mid-stream ends the call with Unavailable within 2 s while another model keeps
answering, and the model serves again within 30 s; a worker that cannot load its model
fails to start with the engine's own error.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from gengate import errors
from gengate.domain import (
    ChoiceConstraint,
    GenerationDelta,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
)
from gengate.models.tiny import TinyModelPaths
from gengate.workers.backend import WorkerBackend, WorkerStartError

pytest.importorskip("llama_cpp")

LONG = StoppingCriteria(max_tokens=1500)


def _engine_options(kind: str, tiny_model: TinyModelPaths) -> dict[str, object]:
    if kind == "llamacpp":
        return {"path": str(tiny_model.gguf_path)}
    return {"model": str(tiny_model.hf_dir)}


async def _kill_mid_stream_and_recover(victim: WorkerBackend, bystander: WorkerBackend) -> None:
    request = GenerationRequest(
        model=victim.name, prompt="hello", stopping=LONG, sampling=SamplingParams(seed=1)
    )
    deltas = 0
    pid = victim.pid
    assert pid is not None
    killed_at = 0.0
    with pytest.raises(errors.Unavailable) as info:
        async for event in victim.generate_stream(request):
            if isinstance(event, GenerationDelta):
                deltas += 1
                if deltas == 3:
                    killed_at = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
    failed_after = time.monotonic() - killed_at
    assert failed_after < 2.0, failed_after
    assert info.value.reason == "WORKER_DIED"
    assert not victim.serving

    answer = await bystander.generate(
        GenerationRequest(model=bystander.name, prompt="hi", stopping=StoppingCriteria(max_tokens=4))
    )
    assert answer.usage.output_tokens == 4

    deadline = time.monotonic() + 30
    while not victim.serving and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert victim.serving, "the model did not serve again within 30 s"
    assert victim.pid not in (None, pid)
    choice = StructuredOutput(ChoiceConstraint(("yes", "no")))
    result = await victim.generate(
        GenerationRequest(
            model=victim.name, prompt="ok?", structured_output=choice, sampling=SamplingParams(seed=2)
        )
    )
    assert result.generations[0].text in ("yes", "no")


@pytest.fixture
async def llama_worker(tiny_model: TinyModelPaths) -> AsyncIterator[WorkerBackend]:
    backend = WorkerBackend(
        "tiny-llama", "llamacpp", _engine_options("llamacpp", tiny_model), restart_backoff_s=(0.2, 2.0)
    )
    await backend.start()
    yield backend
    await backend.aclose()


@pytest.fixture
async def bystander() -> AsyncIterator[WorkerBackend]:
    backend = WorkerBackend("bystander", "scripted", {"text": "a b c d e f"})
    await backend.start()
    yield backend
    await backend.aclose()


async def test_llamacpp_worker_kill_9_mid_stream(
    llama_worker: WorkerBackend, bystander: WorkerBackend
) -> None:
    assert llama_worker.capabilities.max_n > 1 and llama_worker.capabilities.constraints
    await _kill_mid_stream_and_recover(llama_worker, bystander)


async def test_llamacpp_worker_concurrent_streams_and_cancel(llama_worker: WorkerBackend) -> None:
    async def first_deltas(seed: int) -> str:
        text = ""
        stream = llama_worker.generate_stream(
            GenerationRequest(
                model="tiny-llama", prompt="hello", stopping=LONG, sampling=SamplingParams(seed=seed)
            )
        )
        async for event in stream:
            if isinstance(event, GenerationDelta):
                text += event.text
                if len(text) > 10:
                    break
        await stream.aclose()
        return text

    texts = await asyncio.gather(*(first_deltas(s) for s in range(4)))
    assert all(len(t) > 10 for t in texts)
    assert llama_worker.in_flight == 0
    for _ in range(100):
        if await llama_worker.worker_in_flight() == 0:
            break
        await asyncio.sleep(0.05)
    assert await llama_worker.worker_in_flight() == 0


async def test_llamacpp_worker_sigstop_with_deadline(llama_worker: WorkerBackend) -> None:
    pid = llama_worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(errors.DeadlineExceeded):  # raised by the server side: the worker is stopped
            await llama_worker.generate(
                GenerationRequest(model="tiny-llama", prompt="x", deadline=time.monotonic() + 0.8)
            )
        assert llama_worker.in_flight == 0
    finally:
        os.kill(pid, signal.SIGCONT)
    result = await llama_worker.generate(
        GenerationRequest(model="tiny-llama", prompt="x", stopping=StoppingCriteria(max_tokens=3))
    )
    assert result.usage.output_tokens == 3


async def test_llamacpp_worker_with_a_bad_path_fails_to_start(tmp_path: object) -> None:
    backend = WorkerBackend("missing", "llamacpp", {"path": "/nonexistent/model.gguf"})
    with pytest.raises(WorkerStartError) as info:
        await backend.start()
    assert "GGUF file not found: /nonexistent/model.gguf" in info.value.message
    assert "worker output (tail)" in info.value.message


@pytest.mark.parametrize(("kind", "framework"), [("transformers", "torch"), ("mlx", "mlx.core")])
async def test_batched_engine_worker_kill_9_mid_stream(
    tiny_model: TinyModelPaths, bystander: WorkerBackend, kind: str, framework: str
) -> None:
    pytest.importorskip(framework)
    backend = WorkerBackend(
        f"tiny-{kind}", kind, _engine_options(kind, tiny_model), restart_backoff_s=(0.2, 2.0)
    )
    await backend.start()
    try:
        await _kill_mid_stream_and_recover(backend, bystander)
    finally:
        await backend.aclose()


async def test_mlx_worker_that_cannot_load_fails_to_start_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("mlx.core")
    backend = WorkerBackend("broken-mlx", "mlx", {"model": str(tmp_path)})
    with pytest.raises(WorkerStartError) as info:
        await backend.start()
    first = info.value.message.splitlines()[0]
    assert f"model 'broken-mlx': mlx-lm could not load '{tmp_path}'" in first, info.value.message
