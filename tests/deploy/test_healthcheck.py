"""The image's health check script and the retry trailers proxies read, against a real server."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from gengate.api.server import RunningServer, model_health_name, start_server
from gengate.config import parse_config
from gengate_proto.v1 import generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "docker" / "healthcheck.py"


def load_script() -> ModuleType:
    """The script as the image ships it: a file, not a package module."""
    spec = importlib.util.spec_from_file_location("gengate_healthcheck", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = load_script()


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    config = {
        "models": [
            {"name": "echo", "backend": "scripted", "tokens_per_s": 2000},
            {
                "name": "narrow",
                "backend": "scripted",
                "max_concurrency": 1,
                "max_queue": 1,
                "text": "a b c d e f g h",
                "tokens_per_s": 40,
            },
        ]
    }
    running = await start_server(parse_config(config), host="127.0.0.1", port=0)
    yield running
    await running.stop(grace=0.2)


async def run_check(*args: str) -> int:
    status: int = await asyncio.to_thread(healthcheck.main, list(args))
    return status


async def test_serving_server_and_model_are_healthy(server: RunningServer) -> None:
    assert await run_check("--address", server.address) == 0
    assert await run_check("--address", server.address, "--service", model_health_name("echo")) == 0


async def test_unknown_service_and_stopped_server_are_unhealthy(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await run_check("--address", server.address, "--service", "no.such.Service") == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    await server.stop(grace=0.1)
    assert await run_check("--address", server.address, "--timeout", "1") == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


async def test_script_runs_standalone_as_the_image_runs_it(server: RunningServer) -> None:
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(SCRIPT), "--address", server.address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr


async def test_queue_full_carries_retry_after_for_proxies(server: RunningServer) -> None:
    """RESOURCE_EXHAUSTED with RetryInfo also sets `retry-after` and `grpc-retry-pushback-ms`,
    which Envoy's rate-limited retry back-off and gRPC's own retries read (deploy/mesh)."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(model="narrow", prompt="x")
        calls = [asyncio.ensure_future(stub.Generate(request, timeout=10)) for _ in range(3)]
        results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(errors) == 1, results
    error = errors[0]
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(error.trailing_metadata() or ())
    assert trailers["retry-after"] == "1"
    assert trailers["grpc-retry-pushback-ms"] == "1000"
    assert "grpc-status-details-bin" in trailers
