"""Worker lifecycle with the model-free scripted engine: multiplexing, streaming, abort,
deadline, crash (kill -9) and restart, start failures, health listener, GPU env."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from gengate import errors
from gengate.backend import Backend
from gengate.domain import GenerationDelta, GenerationEnd, GenerationRequest, StoppingCriteria, StreamStart
from gengate.engines.scripted import ScriptedOptions
from gengate.workers.backend import GpuRequest, WorkerBackend, WorkerStartError
from gengate.workers.placement import PlacementFile, StaticDeviceProvider

ENV_ENGINE_PATH = {"PYTHONPATH": str(Path(__file__).parent)}
WORDS = " ".join(f"w{i}" for i in range(400))


def scripted(name: str, **options: object) -> WorkerBackend:
    return WorkerBackend(
        name, "scripted", ScriptedOptions.model_validate(options), restart_backoff_s=(0.2, 2.0)
    )


@pytest.fixture
async def slow_worker() -> AsyncIterator[WorkerBackend]:
    backend = scripted("slow", text=WORDS, tokens_per_s=50)
    await backend.start()
    yield backend
    await backend.aclose()


@pytest.fixture
async def fast_worker() -> AsyncIterator[WorkerBackend]:
    backend = scripted("fast", text="hello there world")
    await backend.start()
    yield backend
    await backend.aclose()


async def test_is_a_backend_and_serves(fast_worker: WorkerBackend) -> None:
    assert isinstance(fast_worker, Backend)
    assert fast_worker.serving and fast_worker.pid not in (None, os.getpid())
    assert fast_worker.capabilities.max_n == 16
    result = await fast_worker.generate(GenerationRequest(model="fast", prompt="x", n=2, request_id="r1"))
    assert result.request_id == "r1"
    assert [g.text for g in result.generations] == ["hello there world"] * 2
    assert result.usage.output_tokens == 6


async def test_stream_events_in_order(fast_worker: WorkerBackend) -> None:
    events = [e async for e in fast_worker.generate_stream(GenerationRequest(model="fast", prompt="x"))]
    assert isinstance(events[0], StreamStart)
    assert "".join(e.text for e in events if isinstance(e, GenerationDelta)) == "hello there world"
    assert isinstance(events[-1], GenerationEnd) and events[-1].usage.output_tokens == 3


async def test_many_concurrent_calls_are_multiplexed(fast_worker: WorkerBackend) -> None:
    requests = [
        GenerationRequest(
            model="fast", prompt="x", stopping=StoppingCriteria(max_tokens=1 + i % 3), request_id=str(i)
        )
        for i in range(40)
    ]
    results = await asyncio.gather(*(fast_worker.generate(r) for r in requests))
    assert [r.request_id for r in results] == [str(i) for i in range(40)]
    assert [r.usage.output_tokens for r in results] == [1 + i % 3 for i in range(40)]
    assert fast_worker.in_flight == 0


@pytest.mark.parametrize("call", ["unary", "stream"])
async def test_errors_cross_the_process_boundary_typed(call: str) -> None:
    backend = WorkerBackend("raising", "scripted", {}, target="env_engine:RaisingEngine", env=ENV_ENGINE_PATH)
    await backend.start()

    async def outcome(prompt: str) -> BaseException:
        request = GenerationRequest(model="raising", prompt=prompt)
        with pytest.raises(Exception) as info:
            if call == "unary":
                await backend.generate(request)
            else:
                async for _ in backend.generate_stream(request):
                    pass
        return info.value

    try:
        worker = f"in process {backend.pid}"
        assert backend.pid != os.getpid()
        invalid = await outcome("invalid")
        assert isinstance(invalid, errors.InvalidArgument)
        assert [(v.field, v.description) for v in invalid.violations] == [
            ("request.prompt", f"refused by the engine {worker}")
        ]
        busy = await outcome("busy")
        assert isinstance(busy, errors.Unavailable) and busy.reason == "ENGINE_BUSY"
        assert busy.retry_after_s == 3 and worker in busy.message
        bug = await outcome("bug")  # an engine's own exception arrives as INTERNAL, named
        assert isinstance(bug, errors.Internal) and f"ValueError: a bug {worker}" in bug.message
        assert backend.serving and backend.in_flight == 0 and worker == f"in process {backend.pid}"
    finally:
        await backend.aclose()


async def test_cancel_aborts_in_the_worker(slow_worker: WorkerBackend) -> None:
    stream = slow_worker.generate_stream(GenerationRequest(model="slow", prompt="x"))
    async for event in stream:
        if isinstance(event, GenerationDelta):
            break
    assert slow_worker.in_flight == 1
    await stream.aclose()
    assert slow_worker.in_flight == 0
    for _ in range(50):
        if await slow_worker.worker_in_flight() == 0:
            break
        await asyncio.sleep(0.02)
    assert await slow_worker.worker_in_flight() == 0


async def test_task_cancellation_of_unary_call_aborts(slow_worker: WorkerBackend) -> None:
    task = asyncio.create_task(slow_worker.generate(GenerationRequest(model="slow", prompt="x")))
    await asyncio.sleep(0.3)
    assert await slow_worker.worker_in_flight() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    assert await slow_worker.worker_in_flight() == 0


async def test_kill_9_mid_stream_fails_fast_and_restarts(
    slow_worker: WorkerBackend, fast_worker: WorkerBackend
) -> None:
    changes: list[bool] = []
    slow_worker.add_serving_listener(changes.append)
    first_pid = slow_worker.pid
    assert first_pid is not None

    async def consume() -> int:
        count = 0
        async for event in slow_worker.generate_stream(GenerationRequest(model="slow", prompt="x")):
            count += isinstance(event, GenerationDelta)
        return count

    streams = [asyncio.create_task(consume()) for _ in range(3)]
    unary = asyncio.create_task(slow_worker.generate(GenerationRequest(model="slow", prompt="x")))
    await asyncio.sleep(0.4)
    assert slow_worker.in_flight == 4
    os.kill(first_pid, signal.SIGKILL)
    outcomes = await asyncio.gather(*streams, unary, return_exceptions=True)  # how fast: the soak test
    for outcome in outcomes:
        assert isinstance(outcome, errors.Unavailable), outcome
        assert outcome.reason == "WORKER_DIED" and "SIGKILL" in outcome.message
    assert slow_worker.in_flight == 0
    assert not slow_worker.serving and changes == [False]
    with pytest.raises(errors.Unavailable) as info:
        await slow_worker.generate(GenerationRequest(model="slow", prompt="x"))
    assert info.value.reason == "MODEL_NOT_SERVING"

    # The other model never noticed.
    assert (await fast_worker.generate(GenerationRequest(model="fast", prompt="x"))).generations[0].text

    deadline = time.monotonic() + 30
    while not slow_worker.serving and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert slow_worker.serving and changes == [False, True]
    assert slow_worker.pid not in (None, first_pid) and slow_worker.restarts == 1
    result = await slow_worker.generate(
        GenerationRequest(model="slow", prompt="x", stopping=StoppingCriteria(max_tokens=2))
    )
    assert result.generations[0].text == "w0 w1"


async def test_sigstop_and_deadline_ends_with_deadline_exceeded(slow_worker: WorkerBackend) -> None:
    pid = slow_worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(errors.DeadlineExceeded):
            await slow_worker.generate(GenerationRequest(model="slow", prompt="x", deadline=started + 0.5))
        stream = slow_worker.generate_stream(
            GenerationRequest(model="slow", prompt="x", deadline=started + 1.0)
        )
        with pytest.raises(errors.DeadlineExceeded):
            async for _ in stream:
                pass
        assert slow_worker.in_flight == 0  # both ended by the server side: the worker is stopped
    finally:
        os.kill(pid, signal.SIGCONT)
    # Once resumed, the aborted calls are gone and the worker serves.
    assert await slow_worker.worker_in_flight() == 0
    result = await slow_worker.generate(
        GenerationRequest(model="slow", prompt="x", stopping=StoppingCriteria(max_tokens=1))
    )
    assert result.generations[0].text == "w0"


async def test_worker_that_fails_to_import() -> None:
    backend = WorkerBackend("broken", "scripted", {}, target="gengate.engines.no_such_engine:Nothing")
    with pytest.raises(WorkerStartError) as info:
        await backend.start()
    message = info.value.message
    assert "failed to load the scripted engine" in message
    assert "No module named 'gengate.engines.no_such_engine'" in message
    assert "Traceback" in message  # the worker's own output tail
    assert not backend.serving and backend.pid is None


async def test_worker_that_fails_its_options() -> None:
    backend = WorkerBackend("broken", "scripted", {"latency_s": -1})
    with pytest.raises(WorkerStartError, match="latency_s"):
        await backend.start()


async def test_worker_process_that_dies_before_ready() -> None:
    """The interpreter itself cannot start: no StartFailed message, only EOF and an exit code."""
    crasher = WorkerBackend("crasher", "scripted", {}, env={"PYTHONHOME": "/nonexistent"})
    with pytest.raises(WorkerStartError, match=r"exited before it was ready \(exit code 1\)") as info:
        await crasher.start()
    assert "PYTHONHOME" in info.value.message or "encodings" in info.value.message


async def test_gpu_lease_sets_cuda_visible_devices(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    placement = PlacementFile(path)
    provider = StaticDeviceProvider.fake(4, memory_free=[1, 9, 5, 9])
    backend = WorkerBackend(
        "gpu-model",
        "scripted",
        {},
        target="env_engine:EnvEngine",
        env=ENV_ENGINE_PATH,
        gpu=GpuRequest(num_gpus=2),
        placement=placement,
        device_provider=provider,
    )
    await backend.start()
    try:
        assert backend.lease is not None and backend.lease.devices == (1, 3)
        text = (await backend.generate(GenerationRequest(model="gpu-model", prompt="x"))).generations[0].text
        assert text == "CUDA_VISIBLE_DEVICES=1,3 CUDA_DEVICE_ORDER=PCI_BUS_ID"
        (entry,) = placement.leases()
        assert entry.worker_pid == backend.pid and entry.model == "gpu-model"
    finally:
        await backend.aclose()
    assert placement.leases() == []


async def test_cpu_worker_hides_gpus() -> None:
    backend = WorkerBackend("cpu-model", "scripted", {}, target="env_engine:EnvEngine", env=ENV_ENGINE_PATH)
    await backend.start()
    try:
        text = (await backend.generate(GenerationRequest(model="cpu-model", prompt="x"))).generations[0].text
        assert text.startswith("CUDA_VISIBLE_DEVICES= ")
    finally:
        await backend.aclose()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, only not yet reaped
        return stat.read().split(") ")[1][0] != "Z"


@pytest.mark.parametrize("ending", ["kill -9", "aclose"])
async def test_processes_an_engine_started_end_with_its_worker(ending: str) -> None:
    backend = WorkerBackend(
        "parent", "scripted", {}, target="env_engine:ChildProcessEngine", env=ENV_ENGINE_PATH
    )
    await backend.start()
    try:
        helper = int(
            (await backend.generate(GenerationRequest(model="parent", prompt="x"))).generations[0].text
        )
        assert _alive(helper)
        if ending == "kill -9":
            assert backend.pid is not None
            os.kill(backend.pid, signal.SIGKILL)
        else:
            await backend.aclose()
        deadline = time.monotonic() + 5
        while _alive(helper) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not _alive(helper), "the engine's helper process outlived its worker"
    finally:
        await backend.aclose()
