"""A real grpc.aio server on port 0 per test module, and raw stubs to call it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from gengate.api.server import RunningServer
from gengate_proto.v1 import generation_pb2_grpc
from observe import ServerFactory


@pytest.fixture
async def scripted_server(make_server: ServerFactory) -> RunningServer:
    return await make_server(
        {
            "models": [
                {"name": "echo", "backend": "scripted", "tokens_per_s": 2000},
                {"name": "slow", "backend": "scripted", "text": "a b c d e f g h", "tokens_per_s": 4},
                {
                    "name": "narrow",
                    "backend": "scripted",
                    "max_concurrency": 1,
                    "max_queue": 1,
                    "text": "x y z",
                    "tokens_per_s": 10,
                },
            ]
        }
    )


@pytest.fixture
async def stub(scripted_server: RunningServer) -> AsyncIterator[generation_pb2_grpc.GenerationServiceStub]:
    async with grpc.aio.insecure_channel(scripted_server.address) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)
