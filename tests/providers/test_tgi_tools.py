"""Tool calling on TGI, through the real `huggingface_hub` AsyncInferenceClient against the
loopback TGI: the wire form of tools, tool choice and tool turns, calls returned (unary, with
text or object arguments, and streamed as TGI streams them), validation with a bounded re-ask,
reasoning out, and the requests TGI cannot take refused before any request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("huggingface_hub", reason="huggingface_hub is not installed (extra: gengate[tgi])")

import contract_checks as cc
import tool_contract as ct
from fake_tgi import API_KEY, FakeTGI
from gengate import errors
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    JsonSchemaConstraint,
    ReasoningControl,
    ReasoningEffort,
    Role,
    StreamStart,
    StructuredOutput,
    TextPart,
    ToolCall,
)
from tool_requests import PARIS, WEATHER, ask, chat, deltas


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeTGI]:
    yield from cc.serving(FakeTGI())


@pytest.fixture
async def make(fake: FakeTGI) -> AsyncIterator[cc.Make]:
    from gengate.providers.tgi import TGIBackend

    async with cc.backends(
        TGIBackend, "tgi", fake, model="tgi-test", base_url=fake.server.base_url, api_key=API_KEY
    ) as build:
        yield build


async def test_capabilities_say_native_tools_and_reasoning_out_without_control(make: cc.Make) -> None:
    caps = (await make()).capabilities
    assert (caps.tools, caps.reasoning, caps.reasoning_control) == (Enforcement.NATIVE, True, False)


async def test_tools_and_each_choice_on_the_chat_wire(make: cc.Make, fake: FakeTGI) -> None:
    await ct.check_tools_on_the_wire(await make(), fake, parallel=False)  # TGI has no such switch
    assert {r.path for r in fake.server.requests} == {"/v1/chat/completions"}


@pytest.mark.parametrize("object_arguments", [False, True], ids=["text", "object"])
async def test_unary_call_returned_with_tool_calls(
    make: cc.Make, fake: FakeTGI, object_arguments: bool
) -> None:
    backend = await make()
    fake.object_arguments = object_arguments  # older TGI sends the arguments as a JSON object
    fake.calls.append([("get_weather", json.dumps({"city": "Paris", "unit": "C"}))])
    result = await backend.generate(ask())
    gen = result.generations[0]
    assert len(gen.tool_calls) == 1
    call = gen.tool_calls[0]
    assert (call.id, call.name) == ("0", "get_weather")
    assert isinstance(call.arguments, str) and json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
    # TGI says "stop" after a call: gengate says the model stopped on calls
    assert (gen.finish_reason, gen.text) == (FinishReason.TOOL_CALLS, "")
    assert result.enforcement == Enforcement.NATIVE


async def test_stream_fragments_assemble_into_the_end_frames_call(make: cc.Make, fake: FakeTGI) -> None:
    backend = await make()
    arguments = json.dumps({"city": "Paris", "unit": "C"})
    fake.calls.append([("get_weather", arguments)])
    events = await cc.collect(backend.generate_stream(ask()))
    assert isinstance(events[0], StreamStart) and events[0].enforcement == Enforcement.NATIVE
    fragments = [f for d in deltas(events) for f in d.tool_calls]
    assert len(fragments) > 2  # TGI streams a call token by token
    assert (fragments[0].id, fragments[0].name, fragments[0].arguments) == ("0", "get_weather", "{")
    assert all(f.id == "" and f.name == "" for f in fragments[1:])  # TGI repeats the id: sent once
    assert "".join(f.arguments for f in fragments) == arguments
    end = events[-1]
    # TGI's tool stream carries no finish reason at all: the calls made say how it ended
    assert isinstance(end, GenerationEnd) and end.finish_reason == FinishReason.TOOL_CALLS
    assert end.tool_calls == (ToolCall("0", "get_weather", arguments),)


async def test_a_text_stream_with_tools_offered_ends_as_a_text(make: cc.Make, fake: FakeTGI) -> None:
    backend = await make()
    fake.answers.append("No tool needed here")
    events = await cc.collect(backend.generate_stream(ask()))
    assert "".join(d.text for d in deltas(events)) == "No tool needed here"
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason == FinishReason.STOP and end.tool_calls == ()


async def test_bad_arguments_are_reasked_with_the_calls_and_their_errors(
    make: cc.Make, fake: FakeTGI
) -> None:
    await ct.check_reask(await make(), fake, "0")


async def test_bad_calls_are_reasked_a_bounded_number_of_times(make: cc.Make, fake: FakeTGI) -> None:
    await ct.check_reask_exhausted(await make(), fake)
    fake.reset()
    await ct.check_not_offered_and_parallel_refused(await make(validation_retries=0), fake)


async def test_an_invalid_streamed_call_ends_the_stream_with_validation_failed(
    make: cc.Make, fake: FakeTGI
) -> None:
    await ct.check_invalid_stream_aborts(await make(), fake)


async def test_round_trip_of_a_call_and_its_result(make: cc.Make, fake: FakeTGI) -> None:
    await ct.check_round_trip(await make(), fake, "0")


async def test_reasoning_comes_back_unary_and_streamed(make: cc.Make, fake: FakeTGI) -> None:
    await ct.check_reasoning_out(await make(), fake)


async def test_what_tgi_cannot_take_is_refused_before_any_request(make: cc.Make, fake: FakeTGI) -> None:
    backend = await make()
    on_prompt = GenerationRequest(model="m", prompt="Weather in Paris?", tools=(WEATHER,))
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(on_prompt)
    assert info.value.reason == "TOOLS_UNSUPPORTED" and [v.field for v in info.value.violations] == ["tools"]
    assert "/generate" in info.value.message
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(ask(structured_output=StructuredOutput(JsonSchemaConstraint(cc.PERSON))))
    assert info.value.reason == "TOOLS_UNSUPPORTED"
    assert [v.field for v in info.value.violations] == ["structured_output"]
    both = (
        ChatMessage(Role.USER, (TextPart("Weather in Paris?"),)),
        ChatMessage(
            Role.ASSISTANT, (TextPart("Let me look."),), tool_calls=(ToolCall("0", "get_weather", PARIS),)
        ),
        ChatMessage(Role.TOOL, (TextPart("sunny"),), tool_call_id="0"),
    )
    with pytest.raises(errors.InvalidArgument) as bad:
        await backend.generate(ask(messages=both))
    assert [v.field for v in bad.value.violations] == ["messages.messages[1].content"]
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(chat(reasoning=ReasoningControl(effort=ReasoningEffort.LOW)))
    assert info.value.reason == "REASONING_UNSUPPORTED"
    assert fake.server.requests == []
