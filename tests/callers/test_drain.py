"""Graceful drain: once told to stop, health says NOT_SERVING (overall, the service, each model)
and new calls get UNAVAILABLE with reason DRAINING (a mesh retries them elsewhere), while the
calls in flight, streams included, finish; then the process exits 0."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from gengate_client import AsyncClient
from gengate_client.errors import UnavailableError
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc, jobs_pb2, jobs_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from observe import ServerFactory, reason, until
from serve_process import ServerProcess

SERVICE = "gengate.v1.GenerationService"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SLOW_TEXT = " ".join(f"w{i}" for i in range(60))


def slow_model(tokens_per_s: float) -> dict[str, object]:
    return {"name": "slow", "backend": "scripted", "text": SLOW_TEXT, "tokens_per_s": tokens_per_s}


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return int(reply.status)


async def _all_not_serving(channel: grpc.aio.Channel) -> bool:
    states = [await _health(channel, name) for name in ("", SERVICE, f"{SERVICE}/slow")]
    return all(state == NOT_SERVING for state in states)


async def _refused_as_draining(channel: grpc.aio.Channel) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(g.GenerateRequest(model="slow", prompt="late"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and reason(caught.value) == "DRAINING"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs_pb2_grpc.BatchJobServiceStub(channel).ListBatchJobs(
            jobs_pb2.ListBatchJobsRequest(), timeout=10
        )
    assert reason(caught.value) == "DRAINING"


async def test_a_draining_server_refuses_new_calls_and_finishes_the_running_ones(
    make_server: ServerFactory,
) -> None:
    server = await make_server({"models": [slow_model(40)]})
    async with AsyncClient(server.address) as client, grpc.aio.insecure_channel(server.address) as channel:
        stream = client.generate_stream("slow", "x")
        await anext(stream)
        assert server.drain_state.in_flight == 1
        drained = asyncio.create_task(server.drain(60))
        await until(lambda: server.drain_state.draining, "draining")
        assert await _all_not_serving(channel)
        await _refused_as_draining(channel)
        with pytest.raises(UnavailableError) as caught:
            async for _ in client.generate_stream("slow", "late"):
                pass
        assert caught.value.reason == "DRAINING"
        frames = [f async for f in stream]
        assert frames[-1].finish_reason.name == "STOP"
        assert await drained is True
        assert server.drain_state.in_flight == 0


async def test_a_drain_that_times_out_says_so(make_server: ServerFactory) -> None:
    server = await make_server({"models": [slow_model(2)]})  # 30 s of tokens
    async with AsyncClient(server.address) as client:
        stream = client.generate_stream("slow", "x")
        await anext(stream)
        interrupt = asyncio.Event()
        drained = asyncio.create_task(server.drain(3600, interrupt))
        await until(lambda: server.drain_state.draining, "draining")
        interrupt.set()  # what a second SIGTERM does
        assert await drained is False
        await stream.aclose()


def test_sigterm_drains_ten_streams_then_exits_zero() -> None:
    process = ServerProcess({"models": [slow_model(10)]})  # each stream: 60 tokens, 6 s
    try:
        exit_code, log = asyncio.run(_drain_under_sigterm(process))
    finally:
        if process.proc.poll() is None:
            process.stop()
    assert exit_code == 0, log
    assert "draining: 10 call(s) in flight" in log and "drained: every call finished" in log


async def _drain_under_sigterm(process: ServerProcess) -> tuple[int, str]:
    async with grpc.aio.insecure_channel(process.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = g.GenerateStreamRequest(request=g.GenerateRequest(model="slow", prompt="x"))
        streams = [stub.GenerateStream(request, timeout=120) for _ in range(10)]
        for stream in streams:
            first = await stream.read()
            assert first.WhichOneof("frame") == "start"
            delta = await stream.read()  # a token has arrived: the generation is under way
            assert delta.WhichOneof("frame") == "delta"
        process.proc.send_signal(signal.SIGTERM)
        while not await _all_not_serving(channel):  # health flips at once, before any stream ends
            await asyncio.sleep(0.02)
        await _refused_as_draining(channel)
        ends = []
        for stream in streams:
            frames = []
            while (frame := await stream.read()) is not grpc.aio.EOF:
                frames.append(frame)
            assert await stream.code() == grpc.StatusCode.OK
            ends.append(frames[-1])
        assert all(end.WhichOneof("frame") == "end" for end in ends)
        assert all(end.end.usage.output_tokens == 60 for end in ends)  # whole, not cut short
    exit_code = await asyncio.to_thread(process.proc.wait, 60)
    return exit_code, "".join(process.log)
