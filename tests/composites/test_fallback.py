"""`fallback`: the next model answers only for the configured failures, within the caller's
deadline, before the first token of a stream; capabilities are what every member can do."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from composite_members import KIND, CoreFactory, MemberUnderTest, ServerFactory
from gengate.api.convert import request_to_pb
from gengate.domain import (
    ConstraintKind,
    Enforcement,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    RegexConstraint,
    StreamStart,
    StructuredOutput,
)
from gengate.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from gengate.service import GenerationCore
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc


def member(name: str, **options: Any) -> dict[str, Any]:
    return {"name": name, "backend": KIND, **options}


def fallback(name: str, models: list[str], **options: Any) -> dict[str, Any]:
    return {"name": name, "backend": "fallback", "models": models, **options}


def backend_of(core: GenerationCore, name: str) -> MemberUnderTest:
    backend = core.router.route(name).backend
    assert isinstance(backend, MemberUnderTest)
    return backend


def ask(model: str = "fb", **kw: Any) -> GenerationRequest:
    return GenerationRequest(model=model, prompt="say something", **kw)


async def test_unavailable_member_is_skipped(make_core: CoreFactory) -> None:
    core = await make_core(
        [member("down", fail="UNAVAILABLE"), member("up", text="hello there"), fallback("fb", ["down", "up"])]
    )
    result = await core.generate(ask())
    assert result.model == "fb"
    assert result.generations[0].text == "hello there"
    assert len(backend_of(core, "down").requests) == 1
    # Each member got the request addressed to it, with the service's defaults filled in.
    sent = backend_of(core, "up").requests[0]
    assert sent.model == "up" and sent.stopping.max_tokens is not None
    assert sent.request_id == f"{result.request_id}.f1"


async def test_invalid_argument_is_not_retried(make_core: CoreFactory) -> None:
    core = await make_core(
        [member("bad", fail="INVALID_ARGUMENT"), member("up", text="x"), fallback("fb", ["bad", "up"])]
    )
    with pytest.raises(InvalidArgument, match="bad failed on purpose"):
        await core.generate(ask())
    assert backend_of(core, "up").requests == []


async def test_on_and_max_attempts_are_configurable(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("bad", fail="INVALID_ARGUMENT"),
            member("busy", fail="RESOURCE_EXHAUSTED"),
            member("up", text="fine"),
            fallback("lenient", ["bad", "up"], on=["invalid_argument"]),
            fallback("short", ["busy", "up"], max_attempts=1),
        ]
    )
    assert (await core.generate(ask("lenient"))).generations[0].text == "fine"
    with pytest.raises(ResourceExhausted):
        await core.generate(ask("short"))
    assert len(backend_of(core, "up").requests) == 1


async def test_the_last_error_is_raised_when_every_member_fails(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("a", fail="UNAVAILABLE"),
            member("b", fail="RESOURCE_EXHAUSTED"),
            fallback("fb", ["a", "b"]),
        ]
    )
    with pytest.raises(ResourceExhausted, match="b failed"):
        await core.generate(ask())


async def test_no_next_model_past_the_callers_deadline(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("slow", fail="UNAVAILABLE", latency_s=0.3),
            member("up", text="late"),
            fallback("fb", ["slow", "up"]),
        ]
    )
    # Through the service: the deadline passes while the first member works.
    with pytest.raises(DeadlineExceeded):
        await core.generate(ask(deadline=time.monotonic() + 0.1))
    # The backend itself: a member's call ends at the deadline too, and nothing else is tried.
    fb = core.router.route("fb").backend
    request = ask(deadline=time.monotonic() + 0.05)
    with pytest.raises(DeadlineExceeded):
        await fb.generate(request)
    assert backend_of(core, "up").requests == []
    # With time left, the next model answers.
    assert (await core.generate(ask(deadline=time.monotonic() + 5))).generations[0].text == "late"


async def test_stream_falls_back_before_the_first_token(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("down", fail="UNAVAILABLE"),  # fails after its start event, before any token
            member("up", text="one two"),
            fallback("fb", ["down", "up"]),
        ]
    )
    events = [e async for e in core.generate_stream(ask())]
    starts = [e for e in events if isinstance(e, StreamStart)]
    assert len(starts) == 1 and starts[0].model == "fb"
    assert isinstance(events[0], StreamStart)
    assert "".join(e.text for e in events if isinstance(e, GenerationDelta)) == "one two"
    assert isinstance(events[-1], GenerationEnd)


async def test_stream_error_after_a_token_propagates(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("flaky", fail="UNAVAILABLE", fail_after_deltas=1, text="partial answer"),
            member("up", text="never"),
            fallback("fb", ["flaky", "up"]),
        ]
    )
    received: list[str] = []
    with pytest.raises(Unavailable):
        async for event in core.generate_stream(ask()):
            if isinstance(event, GenerationDelta):
                received.append(event.text)
    assert received == ["partial"]
    assert backend_of(core, "up").requests == []


async def test_capabilities_are_what_every_member_can_do(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member(
                "strong", constraints={"json_schema": "engine", "regex": "engine"}, max_n=4, logprobs=True
            ),
            member("weak", constraints={"json_schema": "validated"}, max_n=2),
            fallback("fb", ["strong", "weak"]),
        ]
    )
    caps = next(m for m in core.list_models() if m.name == "fb").capabilities
    assert caps.constraints == {ConstraintKind.JSON_SCHEMA: Enforcement.VALIDATED}
    assert caps.max_n == 2 and not caps.logprobs
    regex = StructuredOutput(RegexConstraint("[a-z]+"))
    with pytest.raises(Unimplemented):
        await core.generate(ask(structured_output=regex))
    with pytest.raises(InvalidArgument, match="n: must be between 1 and 2"):
        await core.generate(ask(n=3))
    with pytest.raises(Unimplemented):
        await core.generate(ask(logprobs=1))
    assert backend_of(core, "strong").requests == []


async def test_member_limits_apply_to_composite_calls(make_core: CoreFactory) -> None:
    # The first member admits one call and queues none: a second concurrent call is refused
    # there with RESOURCE_EXHAUSTED, and the fallback hands it to the next member.
    core = await make_core(
        [
            {**member("narrow", text="narrow", latency_s=0.3), "max_concurrency": 1, "max_queue": 1},
            member("wide", text="wide"),
            fallback("fb", ["narrow", "wide"]),
        ]
    )
    first = asyncio.create_task(core.generate(ask()))
    await asyncio.sleep(0.05)
    queued = asyncio.create_task(core.generate(ask()))
    await asyncio.sleep(0.05)
    overflow = await core.generate(ask())
    assert overflow.generations[0].text == "wide"
    assert [(await t).generations[0].text for t in (first, queued)] == ["narrow", "narrow"]


async def test_fallback_through_the_server(make_server: ServerFactory) -> None:
    server = await make_server(
        [
            member("down", fail="UNAVAILABLE"),
            {"name": "echo", "backend": "scripted", "text": "served by echo"},
            fallback("fb", ["down", "echo"]),
        ]
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        response = await stub.Generate(request_to_pb(ask()))
        assert response.model == "fb"
        assert response.generations[0].text == "served by echo"
        frames = [f async for f in stub.GenerateStream(g.GenerateStreamRequest(request=request_to_pb(ask())))]
        assert frames[0].WhichOneof("frame") == "start" and frames[0].start.model == "fb"
        listed = await stub.ListModels(g.ListModelsRequest())
        assert {m.name: m.backend for m in listed.models}["fb"] == "fallback"
