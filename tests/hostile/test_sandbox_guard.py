"""With the limits opened wide, the constraint sandbox alone keeps the model up: a grammar and a
schema that overflow the grammar engine's stack are refused for their caller (INVALID_ARGUMENT)
while generations already running on the same model finish, and the worker never restarts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from corpus import chain_lark, lark, ref_chain, req, schema
from gengate.api.server import RunningServer, start_server
from gengate.config import parse_config
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from observe import reason

WIDE_OPEN = {"max_grammar_rules": 100_000, "max_schema_refs": 100_000, "max_constraint_bytes": 4 << 20}


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[RunningServer]:
    config = {
        "server": {"limits": WIDE_OPEN},
        "models": [{"name": "tiny", "backend": "llamacpp", "tiny": True}],
    }
    running = await start_server(parse_config(config), host="127.0.0.1", port=0)
    yield running
    await running.stop(grace=0.5)


async def test_engine_crashing_constraints_cost_only_their_caller(server: RunningServer) -> None:
    tiny = server.router.routes[0].backend
    pid = getattr(tiny, "pid", None)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        running = req(prompt="Once upon a time")
        running.stopping.max_tokens = 48
        streams = [stub.GenerateStream(g.GenerateStreamRequest(request=running)) for _ in range(3)]

        async def drain(call: Any) -> list[Any]:
            return [frame async for frame in call]

        async def refused(message: g.GenerateRequest) -> str:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(message, timeout=120)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            return reason(caught.value)

        frames, reasons = await asyncio.gather(
            asyncio.gather(*(drain(s) for s in streams)),
            asyncio.gather(refused(lark(chain_lark(5000))), refused(schema(ref_chain(6000)))),
        )
        assert reasons == ["CONSTRAINT_TOO_COMPLEX", "CONSTRAINT_TOO_COMPLEX"]
        for stream_frames in frames:
            ends = [f for f in stream_frames if f.HasField("end")]
            assert len(ends) == 1 and ends[0].end.usage.output_tokens > 0
        # the same model still compiles and enforces a good grammar
        ok = await stub.Generate(lark('start: "yes" | "no"'), timeout=60)
        assert ok.generations[0].text in ("yes", "no")
    assert getattr(tiny, "restarts", 0) == 0 and getattr(tiny, "pid", None) == pid
    assert server.core is not None and server.core.sandbox.killed == 4  # each tried twice
