"""Bugs the soak test found, each pinned by a small deterministic test that runs in the default
suite: xfail(strict=True) while the bug is open (a fix then shows up as XPASS and fails the run,
so the marker gets removed), a plain regression test once fixed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from gengate.api.server import model_health_name, start_server
from gengate.config import ModelConfig, parse_config
from gengate.domain import (
    GenerationDelta,
    GenerationRequest,
    GenerationResult,
    ModelCapabilities,
    StreamEvent,
    StreamStart,
)
from gengate.router import Route, Router
from gengate.service import GenerationCore
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import BaseModel
from soak_load import install_tracer_provider


# Regression: the OpenTelemetry aio server interceptor iterates every server-streaming handler,
# but grpc_health's Health.Watch is a coroutine; Watch ended UNKNOWN with tracing on
# (opentelemetry-python-contrib#3066). Health and reflection now bypass that interceptor.
async def test_health_watch_streams_the_model_status_with_tracing_on() -> None:
    install_tracer_provider()
    config = parse_config({"models": [{"name": "echo", "backend": "scripted"}]})
    server = await start_server(config, host="127.0.0.1", port=0)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=model_health_name("echo")), timeout=5
            )
            first = await watch.read()
            watch.cancel()
        assert isinstance(first, health_pb2.HealthCheckResponse)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace=0.5)


class NoOptions(BaseModel):
    pass


class SlowAbortBackend:
    """Streams slowly; when cancelled it takes a moment to abort, as WorkerBackend does while it
    waits for the worker to acknowledge the Abort (ABORT_ACK_TIMEOUT_S)."""

    def __init__(self) -> None:
        self.name = "slow"
        self.kind = "slow-abort"
        self.capabilities = ModelCapabilities()
        self.abort_started = False
        self.abort_over = False  # its generator has left its `finally` (done, or cut short by cancel)

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        raise NotImplementedError  # only streams are used here

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        yield StreamStart(request_id=request.request_id, model=self.name, input_tokens=1)
        try:
            for i in range(1000):
                await asyncio.sleep(0.01)
                yield GenerationDelta(index=0, text=f" w{i}", token_count=1)
        finally:
            self.abort_started = True
            try:
                await asyncio.sleep(0.2)  # the abort round trip
            finally:
                self.abort_over = True


async def test_stream_cancelled_twice_while_the_backend_aborts() -> None:
    """Regression (found by the soak run): with asyncio.wait_for around each anext() of the backend
    stream, a second cancellation of the RPC task while the backend was still aborting left the inner
    anext() task running, so the stream's aclose() raised RuntimeError('aclose(): asynchronous
    generator is already running'): the servicer logged 'unexpected error' and aborted with INTERNAL.
    Fixed by awaiting the stream in the RPC task itself under asyncio.timeout (service.py)."""
    backend = SlowAbortBackend()
    config = ModelConfig(name="slow", backend="slow-abort", options=NoOptions())
    core = GenerationCore(Router([Route(config, backend, asyncio.Semaphore(4))]))
    request = GenerationRequest(model="slow", prompt="x", deadline=time.monotonic() + 30)
    received = asyncio.Event()

    async def consume() -> None:
        async for event in core.generate_stream(request):
            if isinstance(event, GenerationDelta):
                received.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(received.wait(), 5)
    task.cancel()
    await asyncio.sleep(0.05)  # the backend is now inside its abort
    task.cancel()
    outcome = (await asyncio.gather(task, return_exceptions=True))[0]
    assert isinstance(outcome, asyncio.CancelledError), repr(outcome)
    assert backend.abort_started and backend.abort_over, "the backend stream was left to another task"
    assert core.router.route("slow").in_flight == 0
