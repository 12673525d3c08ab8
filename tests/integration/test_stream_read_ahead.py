"""GenerateStream over a real server, with its read-ahead (api/coalesce.py): deltas that were
ready together arrive merged and say so in their token counts, and a stream its caller drops
while the server is blocked writing still closes its source and frees the model's slot."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from gengate.engines.scripted import ScriptedBackend
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t

WORDS = " ".join(f"w{i}" for i in range(200))


async def test_ready_tokens_arrive_merged_with_their_counts(make_server: Any) -> None:
    server = await make_server({"models": [{"name": "echo", "backend": "scripted", "text": WORDS}]})
    request = g.GenerateRequest(model="echo", prompt="x", stopping=t.StoppingCriteria(max_tokens=200))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        unary = await stub.Generate(request, timeout=10)
        frames = [f async for f in stub.GenerateStream(g.GenerateStreamRequest(request=request), timeout=10)]
    deltas = [f.delta for f in frames if f.WhichOneof("frame") == "delta"]
    assert "".join(d.text for d in deltas) == unary.generations[0].text
    assert sum(d.token_count for d in deltas) == frames[-1].end.usage.output_tokens == 200
    assert len(deltas) < 20  # 200 tokens, all ready at once: a few frames, not 200


async def test_a_stream_dropped_mid_write_closes_its_source_and_frees_the_slot(make_server: Any) -> None:
    text = "word " * 1_000_000  # more than flow control lets through unread
    server = await make_server(
        {"models": [{"name": "one", "backend": "scripted", "text": text, "max_concurrency": 1}]}
    )
    backend = next(r for r in server.router.routes if r.name == "one").backend
    assert isinstance(backend, ScriptedBackend)
    request = g.GenerateRequest(model="one", prompt="x", stopping=t.StoppingCriteria(max_tokens=1_000_000))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        call = stub.GenerateStream(g.GenerateStreamRequest(request=request), timeout=30)
        assert (await call.read()).WhichOneof("frame") == "start"
        await asyncio.sleep(0.3)  # not reading: the server blocks writing
        call.cancel()
        for _ in range(200):
            if backend.cancelled and server.drain_state.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert backend.cancelled == 1  # the generation was abandoned, not run on
        short = g.GenerateRequest(model="one", prompt="x", stopping=t.StoppingCriteria(max_tokens=2))
        answer = await stub.Generate(short, timeout=10)  # the one slot is free again
        assert answer.generations[0].text
