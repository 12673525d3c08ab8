"""Worker guarantees that mutants of workers/backend.py showed untested: a dead worker's error says
when to come back (the restart backoff, back to its start after a stable run), a ping in flight
fails with it instead of waiting out its timeout, a restart that fails is retried, a closed
backend reports not serving and never restarts, a stopped worker's deadline names itself, and a
CPU-capable engine on a node without GPUs runs on the CPU."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import pytest
from gengate import errors
from gengate.domain import GenerationRequest, StoppingCriteria
from gengate.engines.scripted import ScriptedOptions
from gengate.workers.backend import GpuRequest, WorkerBackend, WorkerStartError
from gengate.workers.placement import PlacementError, PlacementFile, StaticDeviceProvider
from observe import until

ENV_ENGINE_PATH = {"PYTHONPATH": str(Path(__file__).parent)}
WORDS = " ".join(f"w{i}" for i in range(400))


def slow(name: str, *, stable_after_s: float, **kwargs: object) -> WorkerBackend:
    options = ScriptedOptions(text=WORDS, tokens_per_s=50)
    return WorkerBackend(
        name,
        "scripted",
        options,
        restart_backoff_s=(0.2, 2.0),
        stable_after_s=stable_after_s,
        **kwargs,  # type: ignore[arg-type]
    )


async def killed_mid_call(backend: WorkerBackend) -> errors.Unavailable:
    """Kills the worker under a unary call; the call's error."""
    pid = backend.pid
    assert pid is not None
    call = asyncio.create_task(backend.generate(GenerationRequest(model=backend.name, prompt="x")))
    await until(lambda: backend.in_flight == 1, "the call reached the worker")
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(errors.Unavailable) as info:
        await call
    assert info.value.reason == "WORKER_DIED"
    return info.value


async def serving_again(backend: WorkerBackend, after: int) -> None:
    await until(lambda: backend.serving and backend.restarts > after, "the worker serves again")


@pytest.mark.parametrize(("stable_after_s", "second_hint"), [(3600.0, 0.4), (0.0, 0.2)])
async def test_worker_died_says_when_to_come_back(stable_after_s: float, second_hint: float) -> None:
    """RetryInfo is the restart backoff: doubled by a second death soon after, back to its start
    after a run longer than stable_after_s."""
    backend = slow(f"dying-{stable_after_s:g}", stable_after_s=stable_after_s)
    await backend.start()
    try:
        first = await killed_mid_call(backend)
        assert first.retry_after_s == pytest.approx(0.2)
        await serving_again(backend, 0)
        second = await killed_mid_call(backend)
        assert second.retry_after_s == pytest.approx(second_hint)
    finally:
        await backend.aclose()


async def test_a_ping_in_flight_fails_when_the_worker_dies() -> None:
    backend = slow("pinged", stable_after_s=3600.0)
    await backend.start()
    pid = backend.pid
    assert pid is not None
    try:
        os.kill(pid, signal.SIGSTOP)  # the ping cannot be answered
        ping = asyncio.create_task(backend.worker_in_flight(timeout_s=600))
        await asyncio.sleep(0)  # the ping is sent
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(errors.Unavailable) as info:
            await ping  # not after 600 s: the death fails it
        assert info.value.reason == "WORKER_DIED"
    finally:
        await backend.aclose()


async def test_a_restart_that_fails_is_tried_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    gate = tmp_path / "closed"
    backend = WorkerBackend(
        "gated",
        "scripted",
        {"text": "a b c"},
        target="env_engine:StartGateEngine",
        env={**ENV_ENGINE_PATH, "GENGATE_TEST_START_GATE": str(gate)},
        restart_backoff_s=(0.1, 0.2),
    )
    await backend.start()
    try:
        gate.touch()  # from now on a start fails
        pid = backend.pid
        assert pid is not None
        with caplog.at_level(logging.ERROR, logger="gengate.workers.backend"):
            os.kill(pid, signal.SIGKILL)
            await until(lambda: "restart failed" in caplog.text, "a restart failed")
        assert not backend.serving
        gate.unlink()
        await serving_again(backend, 0)
        result = await backend.generate(
            GenerationRequest(model="gated", prompt="x", stopping=StoppingCriteria(max_tokens=2))
        )
        assert result.generations[0].text == "a b"
    finally:
        await backend.aclose()


async def test_a_closed_backend_is_not_serving_and_never_restarts() -> None:
    backend = slow("closing", stable_after_s=3600.0)
    changes: list[bool] = []
    backend.add_serving_listener(changes.append)
    await backend.start()
    pid = backend.pid
    assert pid is not None
    closing = asyncio.create_task(backend.aclose())
    await asyncio.sleep(0)  # the close has begun: its worker is told to shut down, not gone yet
    assert not closing.done() and backend.serving is False, "not serving from the moment it closes"
    await closing
    assert not backend.serving and changes[-1] is False
    assert backend._restart_task is None and backend.restarts == 0  # its own kill is no crash
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(errors.Unavailable) as info:
        await backend.generate(GenerationRequest(model="closing", prompt="x"))
    assert info.value.reason == "MODEL_NOT_SERVING" and "closed" in info.value.message
    assert info.value.retry_after_s is None  # a closed model gives no time to come back


async def test_a_stopped_workers_deadline_names_itself() -> None:
    backend = slow("stopped", stable_after_s=3600.0)
    await backend.start()
    pid = backend.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(errors.DeadlineExceeded) as info:
            await backend.generate(
                GenerationRequest(model="stopped", prompt="x", deadline=time.monotonic() + 0.3)
            )
        assert info.value.reason == "DEADLINE" and "'stopped'" in info.value.message
    finally:
        os.kill(pid, signal.SIGCONT)
        await backend.aclose()


async def test_without_gpus_a_cpu_engine_runs_on_cpu_and_a_gpu_engine_refuses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    none = StaticDeviceProvider.fake(0)
    placement = PlacementFile(tmp_path / "placement.json")

    def on_node(name: str, required: bool) -> WorkerBackend:
        return WorkerBackend(
            name,
            "scripted",
            {},
            target="env_engine:EnvEngine",
            env=ENV_ENGINE_PATH,
            gpu=GpuRequest(required=required),
            placement=placement,
            device_provider=none,
        )

    cpu = on_node("cpu-capable", required=False)
    with caplog.at_level(logging.WARNING, logger="gengate.workers.backend"):
        await cpu.start()
    try:
        assert "model 'cpu-capable' runs on CPU" in caplog.text
        text = (await cpu.generate(GenerationRequest(model="cpu-capable", prompt="x"))).generations[0].text
        assert text.startswith("CUDA_VISIBLE_DEVICES= ")
    finally:
        await cpu.aclose()
    gpu_only = on_node("gpu-only", required=True)
    with pytest.raises(PlacementError) as info:
        await gpu_only.start()
    assert info.value.reason == "NO_GPU"


async def test_a_start_failure_names_its_model_in_the_error_details() -> None:
    backend = WorkerBackend("broken", "scripted", {}, target="gengate.engines.no_such_engine:Nothing")
    with pytest.raises(WorkerStartError) as info:
        await backend.start()
    assert info.value.metadata == {"model": "broken"}
