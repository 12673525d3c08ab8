"""Magpie requests are admitted like any other call, every turn of them: a unary call finds a full
queue full, BatchGenerate items wait for room instead, and a batch job's Magpie items run below
interactive callers (background). Written against mutants of service.py that survived
(tests/mutation/SURVIVORS.md, "Third run": the queue bound and background flag handed to Magpie)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc, jobs_pb2_grpc
from gengate_proto.v1 import jobs_pb2 as j
from gengate_proto.v1 import types_pb2 as t
from observe import ServerFactory, field_violations, reason, until

# One slot, room for one waiting call; each turn takes a while, so the test can see who waits.
NARROW = {"name": "narrow", "backend": "scripted", "raw_prompt": True, "text": "a b c d e f",
          "tokens_per_s": 60, "max_concurrency": 1, "max_queue": 1}  # fmt: skip


def magpie(turns: int = 1, **pre_query: object) -> g.GenerateRequest:
    pre_query = pre_query or {"template": "<user>"}
    return g.GenerateRequest(model="narrow", magpie=t.Magpie(n_turns=turns, **pre_query))  # type: ignore[arg-type]


def plain(prompt: str) -> g.GenerateRequest:
    return g.GenerateRequest(model="narrow", prompt=prompt)


async def test_a_magpie_call_finds_a_full_queue_full(make_server: ServerFactory) -> None:
    server = await make_server({"models": [NARROW]})
    route = server.router.route("narrow")
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        running = asyncio.ensure_future(stub.Generate(plain("one")))
        await until(lambda: route.in_flight == 1, "a call runs")
        queued = asyncio.ensure_future(stub.Generate(plain("two")))
        await until(lambda: route.waiting == 1, "another waits: the queue is full")
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await stub.Generate(magpie())
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reason(full.value) == "QUEUE_FULL"
        await asyncio.gather(running, queued)
        # with room, it is written turn after turn
        reply = await stub.Generate(magpie(turns=2, preset=t.MAGPIE_PRESET_QWEN2))
    roles = [m.role for m in reply.generations[0].conversation]
    assert roles == [t.ROLE_USER, t.ROLE_ASSISTANT] * 2


async def test_magpie_items_of_a_batch_wait_for_room_instead_of_failing(make_server: ServerFactory) -> None:
    server = await make_server({"models": [NARROW]})
    route = server.router.route("narrow")
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        running = asyncio.ensure_future(stub.Generate(plain("one")))
        await until(lambda: route.in_flight == 1, "a call runs")
        queued = asyncio.ensure_future(stub.Generate(plain("two")))
        await until(lambda: route.waiting == 1, "another waits: the queue is full")
        batch = g.BatchGenerateRequest(requests=[magpie(), magpie()])
        items = [item async for item in stub.BatchGenerate(batch)]
        await asyncio.gather(running, queued)
    assert [i.WhichOneof("result") for i in items] == ["response", "response"], [
        i.error.message for i in items
    ]


async def test_a_jobs_magpie_items_wait_below_interactive_callers(make_server: ServerFactory) -> None:
    server = await make_server({"models": [NARROW], "server": {"jobs": {"concurrency": 5}}})
    route = server.router.route("narrow")
    async with grpc.aio.insecure_channel(server.address) as channel:
        jobs = jobs_pb2_grpc.BatchJobServiceStub(channel)
        calls = generation_pb2_grpc.GenerationServiceStub(channel)
        job = (await jobs.CreateBatchJob(j.CreateBatchJobRequest(requests=[magpie()] * 8))).job
        await until(lambda: route.in_flight == 1 and route.background_waiting == 4, "the job's items wait")
        reply = await calls.Generate(plain("now"))  # not refused by the queue limit, not behind them
        assert reply.generations[0].text == "a b c d e f"
        await jobs.CancelBatchJob(j.CancelBatchJobRequest(id=job.id))


async def test_a_custom_template_that_cannot_write_a_later_turn_is_refused_before_any_call(
    make_server: ServerFactory,
) -> None:
    """Without the model's chat template, a second user turn cannot follow a custom pre-query:
    UNIMPLEMENTED naming magpie.template up front (it was an unexpected error after the first
    turn had been written)."""
    server = await make_server({"models": [NARROW]})
    backend = server.router.route("narrow").backend
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(magpie(turns=2))
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert reason(refused.value) == "MAGPIE_UNSUPPORTED"
    assert field_violations(refused.value) == ["magpie.template"]
    assert getattr(backend, "calls", None) == 0
