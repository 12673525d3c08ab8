"""Every hostile-input case gets its expected status, with small, readable details, while the
server goes on serving: the worker never dies, health keeps answering, and a good request works
after each case."""

from __future__ import annotations

import asyncio
import base64
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from corpus import CASES, SERVER_CONFIG, Case, req
from gengate.api.server import RunningServer, model_health_name, start_server
from gengate.config import parse_config
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

MAX_TRAILER_BYTES = 8 * 1024
SERVICE = "/gengate.v1.GenerationService/"


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[RunningServer]:
    running = await start_server(parse_config(SERVER_CONFIG), host="127.0.0.1", port=0)
    yield running
    await running.stop(grace=0.5)


@pytest.fixture(scope="module")
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    options = [("grpc.max_send_message_length", 200 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(server.address, options=options) as chan:
        yield chan


class HealthProbe:
    """Checks health every 20 ms while the corpus runs; every probe must answer."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = health_pb2_grpc.HealthStub(channel)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            try:
                answer = await self.stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                if answer.status != health_pb2.HealthCheckResponse.SERVING:
                    self.failures.append(f"status {answer.status}")
            except grpc.aio.AioRpcError as exc:
                self.failures.append(f"{exc.code().name}: {exc.details()}")
            self.latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.02)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def outcome(
    channel: grpc.aio.Channel, case: Case
) -> tuple[grpc.StatusCode, grpc.aio.AioRpcError | None, Any]:
    """Sends the case; returns (code, the error if any, the responses)."""
    message = case.request()
    try:
        if case.rpc == "generate":
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            return grpc.StatusCode.OK, None, await stub.Generate(message, timeout=120)
        if case.rpc == "stream":
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            return grpc.StatusCode.OK, None, [f async for f in stub.GenerateStream(message, timeout=120)]
        if case.rpc == "batch":
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            return grpc.StatusCode.OK, None, [f async for f in stub.BatchGenerate(message, timeout=120)]
        method = case.rpc.removeprefix("raw:")
        if method in ("GenerateStream", "BatchGenerate"):
            call = channel.unary_stream(SERVICE + method)
            return grpc.StatusCode.OK, None, [f async for f in call(message, timeout=120)]
        return grpc.StatusCode.OK, None, await channel.unary_unary(SERVICE + method)(message, timeout=120)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc, None


def _details(error: grpc.aio.AioRpcError) -> tuple[str, list[str]]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status in the trailers"
    reason, fields = "", []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return reason, fields


def wire_trailer_bytes(error: grpc.aio.AioRpcError) -> int:
    """The trailers' size as sent: grpc-message percent-encoded, binary values base64-encoded."""
    size = len("grpc-message") + len(urllib.parse.quote((error.details() or "").encode("utf-8"), safe=" "))
    for key, value in error.trailing_metadata() or ():
        data = value if isinstance(value, bytes) else str(value).encode()
        size += len(key) + (len(base64.b64encode(data)) if key.endswith("-bin") else len(data))
    return size


def _check_error_shape(error: grpc.aio.AioRpcError, case: Case) -> None:
    size = wire_trailer_bytes(error)
    assert size < MAX_TRAILER_BYTES, f"{case.name}: trailers of {size} bytes"
    message = error.details() or ""
    assert len(message.encode()) <= 1024, f"{case.name}: a {len(message)}-character message"
    assert "Traceback" not in message and 'File "' not in message
    reason, fields = _details(error)
    assert reason, f"{case.name}: no ErrorInfo reason"
    assert reason != "UNEXPECTED", f"{case.name}: {message}"
    if case.reason is not None:
        assert reason == case.reason, f"{case.name}: reason {reason}, message {message}"
    if case.field is not None:
        assert case.field in fields, f"{case.name}: fields {fields}, message {message}"


def test_the_corpus_is_large_and_names_are_unique() -> None:
    assert len(CASES) >= 100
    assert len({c.name for c in CASES}) == len(CASES)


async def test_every_hostile_case_gets_its_status_and_the_server_keeps_serving(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    tiny = next(r for r in server.router.routes if r.name == "tiny").backend
    pid = getattr(tiny, "pid", None)
    probe = HealthProbe(channel)
    probe.start()
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    wrong: list[str] = []
    try:
        for case in CASES:
            code, error, responses = await outcome(channel, case)
            if code != case.code:
                detail = error.details() if error is not None else ""
                wrong.append(f"{case.name}: {code.name} (expected {case.code.name}) {detail[:300]}")
                continue
            if error is not None:
                try:
                    _check_error_shape(error, case)
                except AssertionError as exc:
                    wrong.append(str(exc).splitlines()[0])
                    continue
            if case.items:
                got = {
                    r.index: grpc.StatusCode.OK if r.HasField("response") else _code(r.error.code)
                    for r in responses
                }
                assert got == case.items, f"{case.name}: {got}"
                for r in responses:
                    if r.HasField("error"):
                        assert len(r.error.SerializeToString()) < MAX_TRAILER_BYTES
                        assert len(r.error.message) <= 1024
        # the engine worker never died and still generates
        answer = await stub.Generate(req(), timeout=60)
        assert answer.generations
    finally:
        await probe.stop()
    assert not wrong, "\n".join(wrong)
    assert getattr(tiny, "restarts", 0) == 0
    assert getattr(tiny, "pid", None) == pid
    assert not probe.failures, probe.failures
    assert probe.latencies, "health was never checked"
    health = health_pb2_grpc.HealthStub(channel)
    state = await health.Check(health_pb2.HealthCheckRequest(service=model_health_name("tiny")))
    assert state.status == health_pb2.HealthCheckResponse.SERVING
    print(
        f"\nhostile corpus: {len(CASES)} cases, worst health-check latency "
        f"{max(probe.latencies) * 1000:.0f} ms over {len(probe.latencies)} checks"
    )


def _code(value: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == value)


async def test_in_flight_generations_survive_hostile_requests(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    """Streams running on the engine finish normally while grammar and regex bombs arrive."""
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    long_request = req(prompt="Once upon a time")
    long_request.stopping.max_tokens = 64
    streams = [
        stub.GenerateStream(g.GenerateStreamRequest(request=long_request), timeout=120) for _ in range(3)
    ]
    bombs = [c for c in CASES if c.rpc == "generate" and ("chain" in c.name or "bomb" in c.name)]
    assert len(bombs) >= 5

    async def drain(call: Any) -> list[Any]:
        return [frame async for frame in call]

    frames, outcomes = await asyncio.gather(
        asyncio.gather(*(drain(s) for s in streams)),
        asyncio.gather(*(outcome(channel, c) for c in bombs)),
    )
    for case, (code, _, _) in zip(bombs, outcomes, strict=True):
        assert code == case.code, case.name
    for stream_frames in frames:
        ends = [f for f in stream_frames if f.HasField("end")]
        assert len(ends) == 1 and ends[0].end.usage.output_tokens > 0


async def test_large_requests_are_known_large_without_measuring_them_again(
    server: RunningServer, channel: grpc.aio.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size a request arrived with reaches the core (which checks large ones off the loop)."""
    assert server.core is not None
    seen: list[int] = []
    checked = server.core._checked

    def spy(route: Any, request: Any) -> Any:
        seen.append(request.wire_bytes)
        return checked(route, request)

    monkeypatch.setattr(server.core, "_checked", spy)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    small, large = req(model="validated"), req(model="validated", prompt="p" * 200_000)
    await stub.Generate(small, timeout=60)
    await stub.Generate(large, timeout=60)
    [frame async for frame in stub.GenerateStream(g.GenerateStreamRequest(request=large), timeout=60)]
    [item async for item in stub.BatchGenerate(g.BatchGenerateRequest(requests=[large, small]), timeout=60)]
    assert seen[0] == small.ByteSize()
    assert seen[1] == large.ByteSize()
    assert seen[2] >= large.ByteSize()  # the stream request wraps it
    assert sorted(seen[3:]) == sorted([large.ByteSize(), small.ByteSize()])
