"""`mixture_of_agents`: proposals reach the aggregator, which enforces the constraint; usage
counts every call; cancellation and deadlines reach the proposals still running."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import jsonschema
import pytest
from composite_members import KIND, CoreFactory, MemberUnderTest, ServerFactory
from gengate.api.convert import request_to_pb
from gengate.composites.mixture import DEFAULT_AGGREGATOR_PROMPT
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    JsonSchemaConstraint,
    Role,
    SamplingParams,
    StoppingCriteria,
    StreamStart,
    StructuredOutput,
    TextPart,
    Usage,
)
from gengate.errors import DeadlineExceeded, Unavailable
from gengate.service import GenerationCore
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def member(name: str, **options: Any) -> dict[str, Any]:
    return {"name": name, "backend": KIND, **options}


def moa(proposers: list[str], aggregator: str = "agg", **options: Any) -> dict[str, Any]:
    return {
        "name": "moa",
        "backend": "mixture_of_agents",
        "proposers": proposers,
        "aggregator": aggregator,
        **options,
    }


def backend_of(core: GenerationCore, name: str) -> MemberUnderTest:
    backend = core.router.route(name).backend
    assert isinstance(backend, MemberUnderTest)
    return backend


def chat(*messages: tuple[Role, str], **kw: Any) -> GenerationRequest:
    kw.setdefault("model", "moa")
    return GenerationRequest(
        messages=tuple(ChatMessage(role, (TextPart(text),)) for role, text in messages), **kw
    )


async def test_proposals_reach_the_aggregator(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("p1", text="Paris is the capital."),
            member("p2", text="It is Paris."),
            member("agg"),  # echoes every message it receives
            moa(["p1", "p2"]),
        ]
    )
    schema = StructuredOutput(JsonSchemaConstraint({"type": "string"}))
    request = chat((Role.USER, "Capital of France?"), stopping=StoppingCriteria(max_tokens=50))
    result = await core.generate(request)
    assert result.model == "moa"
    text = result.generations[0].text
    assert text.startswith("[system] " + DEFAULT_AGGREGATOR_PROMPT.split("{")[0][:40])
    assert "1. Paris is the capital.\n2. It is Paris." in text
    assert text.endswith("[user] Capital of France?")
    # Proposers saw the original input, alone, as one plain generation each.
    for name in ("p1", "p2"):
        (sent,) = backend_of(core, name).requests
        assert sent.messages == request.messages and sent.n == 1 and sent.structured_output is None
    # The aggregator gets the caller's structured output, n and sampling.
    core2 = await make_core(
        [
            member("p", text="x"),
            member("agg", text='"ok"', constraints={"json_schema": "engine"}),
            moa(["p"]),
        ]
    )
    result = await core2.generate(
        chat((Role.USER, "q"), n=2, structured_output=schema, sampling=SamplingParams(temperature=0.3))
    )
    (sent,) = backend_of(core2, "agg").requests
    assert sent.structured_output == schema and sent.n == 2 and sent.sampling.temperature == 0.3
    assert [g.text for g in result.generations] == ['"ok"', '"ok"']
    (proposal,) = backend_of(core2, "p").requests
    assert proposal.structured_output is None and proposal.n == 1


async def test_a_system_message_and_a_prompt_carry_the_proposals(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("p", text="draft"),
            member("agg"),
            moa(["p", "p"], aggregator_prompt="Drafts:\n{responses}\nBe brief."),
        ]
    )
    result = await core.generate(chat((Role.SYSTEM, "You are terse."), (Role.USER, "Hi")))
    assert (
        result.generations[0].text
        == "[system] You are terse.\n\nDrafts:\n1. draft\n2. draft\nBe brief.\n[user] Hi"
    )
    # The same model twice proposes with two different seeds.
    seeds = {r.sampling.seed for r in backend_of(core, "p").requests}
    result = await core.generate(
        GenerationRequest(model="moa", prompt="Hello", sampling=SamplingParams(seed=5))
    )
    assert result.generations[0].text.endswith("[user] Hello")
    assert [r.sampling.seed for r in backend_of(core, "p").requests[2:]] == [5, 6]
    assert len(seeds) <= 2


async def test_usage_counts_every_call(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("p1", text="alpha beta"),
            member("p2", text="gamma"),
            member("agg", text="final answer here"),
            moa(["p1", "p2"]),
        ]
    )
    result = await core.generate(chat((Role.USER, "q")))
    # Each test member reports 7 input tokens; output: 2 + 1 proposed, 3 aggregated.
    assert result.usage == Usage(21, 6)
    assert result.generations[0].output_tokens == 3
    events = [e async for e in core.generate_stream(chat((Role.USER, "q")))]
    assert isinstance(events[0], StreamStart) and events[0].model == "moa"
    assert events[0].input_tokens == 21
    ends = [e for e in events if isinstance(e, GenerationEnd)]
    assert sum((e.usage for e in ends), Usage()) == Usage(21, 6)
    assert "".join(e.text for e in events if isinstance(e, GenerationDelta)) == "final answer here"


async def test_rounds_show_each_round_the_previous_answers(make_core: CoreFactory) -> None:
    core = await make_core(
        [member("p1", text="first"), member("p2"), member("agg", text="done"), moa(["p1", "p2"], rounds=2)]
    )
    await core.generate(GenerationRequest(model="moa", prompt="topic"))
    round1, round2 = backend_of(core, "p2").requests
    assert round1.prompt == "topic" and round1.messages is None
    assert round2.messages is not None and round2.messages[0].role is Role.SYSTEM
    assert "1. first\n2. topic" in round2.messages[0].text  # p2 echoed the prompt in round 1
    (final,) = backend_of(core, "agg").requests
    assert final.messages is not None
    assert "1. first\n2. [system]" in final.messages[0].text


async def test_a_failed_proposer_is_left_out_unless_all_fail(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("down", fail="UNAVAILABLE"),
            member("up", text="useful"),
            member("agg"),
            moa(["down", "up"]),
            {**moa(["down"]), "name": "hopeless"},
        ]
    )
    text = (await core.generate(chat((Role.USER, "q")))).generations[0].text
    assert "1. useful\n[user] q" in text
    with pytest.raises(Unavailable):
        await core.generate(chat((Role.USER, "q"), model="hopeless"))
    assert len(backend_of(core, "agg").requests) == 1


async def test_cancellation_and_deadline_reach_running_proposals(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("slow1", text="a", latency_s=5),
            member("slow2", text="b", latency_s=5),
            member("agg"),
            moa(["slow1", "slow2"]),
        ]
    )
    task = asyncio.create_task(core.generate(chat((Role.USER, "q"))))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [backend_of(core, n).cancelled for n in ("slow1", "slow2")] == [1, 1]
    assert all(core.router.route(n).in_flight == 0 for n in ("slow1", "slow2", "moa"))
    with pytest.raises(DeadlineExceeded):
        await core.generate(chat((Role.USER, "q"), deadline=time.monotonic() + 0.2))
    # the deadline aborted both proposers (not only the caller's wait), and nothing reached the aggregator
    assert [backend_of(core, n).cancelled for n in ("slow1", "slow2")] == [2, 2]
    assert backend_of(core, "agg").requests == []


async def test_capabilities_are_the_aggregators(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("p"),
            member("agg", constraints={"json_schema": "engine", "regex": "native"}, max_n=3, logprobs=True),
            moa(["p"]),
        ]
    )
    caps = next(m for m in core.list_models() if m.name == "moa").capabilities
    assert caps == backend_of(core, "agg").capabilities


async def test_the_tiny_model_aggregates_into_a_json_schema(make_core: CoreFactory) -> None:
    """A real engine as aggregator: its grammar engine enforces the schema on the synthesis."""
    core = await make_core(
        [
            member("p1", text='{"name": "Ann", "age": 31}'),
            member("p2", text="Ann is thirty-one years old."),
            {"name": "tiny", "backend": "llamacpp", "tiny": True, "isolation": "inline"},
            moa(["p1", "p2"], aggregator="tiny"),
        ]
    )
    request = chat(
        (Role.USER, "Who is Ann? Answer in JSON."),
        n=2,
        structured_output=StructuredOutput(JsonSchemaConstraint(PERSON)),
        stopping=StoppingCriteria(max_tokens=120),
        sampling=SamplingParams(seed=7, temperature=1.0),
    )
    result = await core.generate(request)
    assert result.enforcement is Enforcement.ENGINE
    assert len(result.generations) == 2
    for generation in result.generations:
        if generation.finish_reason is FinishReason.STOP:
            jsonschema.validate(json.loads(generation.text), PERSON)
    assert any(g.finish_reason is FinishReason.STOP for g in result.generations)
    # Proposals count: 2 x 7 input tokens and 4 + 5 output tokens on top of the tiny model's.
    tiny_output = sum(g.output_tokens for g in result.generations)
    assert result.usage.output_tokens == tiny_output + 4 + 5
    assert result.usage.input_tokens > 14


async def test_mixture_through_the_server(make_server: ServerFactory) -> None:
    server = await make_server(
        [
            {"name": "one", "backend": "scripted", "text": "answer one"},
            {"name": "two", "backend": "scripted", "text": "answer two"},
            member("agg"),
            moa(["one", "two"]),
        ]
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        response = await stub.Generate(request_to_pb(chat((Role.USER, "question"))))
        assert response.model == "moa"
        assert "1. answer one\n2. answer two" in response.generations[0].text
        frames = [
            f
            async for f in stub.GenerateStream(
                g.GenerateStreamRequest(request=request_to_pb(chat((Role.USER, "q"))))
            )
        ]
        assert frames[0].start.model == "moa"
        streamed = "".join(f.delta.text for f in frames if f.WhichOneof("frame") == "delta")
        assert "2. answer two\n[user] q" in streamed
