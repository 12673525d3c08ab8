"""kill -9 of an engine worker, seen over gRPC in the default run (not only in the soak test):
the model's health goes NOT_SERVING and back to SERVING, calls meanwhile get UNAVAILABLE with
RetryInfo, and a second crash soon after waits twice as long before its restart."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal

import grpc
import pytest
from gengate.api.server import model_health_name
from gengate.workers.backend import WorkerBackend
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from observe import ServerFactory, until


async def test_health_follows_a_killed_worker_and_restarts_back_off(
    make_server: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gengate.workers.backend")
    server = await make_server(
        {"models": [{"name": "w", "backend": "scripted", "isolation": "process", "text": "a b c"}]}
    )
    backend = server.router.routes[0].backend
    assert isinstance(backend, WorkerBackend)
    seen: list[str] = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def watch() -> None:
            request = health_pb2.HealthCheckRequest(service=model_health_name("w"))
            while True:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(
                    (await health.Check(request, timeout=5)).status
                )
                if not seen or seen[-1] != status:
                    seen.append(status)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        try:
            await until(lambda: seen == ["SERVING"], "health says SERVING")
            for crash in (1, 2):
                pid = backend.pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                await until(lambda: not backend.serving, "the worker's death is noticed")
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Generate(g.GenerateRequest(model="w", prompt="x"), timeout=30)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
                assert status is not None
                assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
                await until(lambda pid=pid: backend.serving and backend.pid != pid, f"restart {crash}")
                await until(
                    lambda crash=crash: seen[-1] == "SERVING" and seen.count("NOT_SERVING") == crash,
                    "health back",
                )
                answer = await stub.Generate(g.GenerateRequest(model="w", prompt="x"), timeout=30)
                assert answer.generations[0].text == "a b c"
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    assert seen == ["SERVING", "NOT_SERVING", "SERVING", "NOT_SERVING", "SERVING"]
    assert backend.restarts == 2
    delays = [
        float(m.group(1))
        for record in caplog.records
        if (m := re.search(r"restarting its worker in ([0-9.]+) s", record.getMessage()))
    ]
    assert len(delays) == 2 and delays[1] == 2 * delays[0], delays  # the second crash waits longer
