"""Tool calling and thinking on Anthropic, through the real `anthropic` SDK against the loopback
Messages API: the wire form of tools, tool choice, tool turns and thinking blocks, calls returned
(unary and streamed), validation with a bounded re-ask, and thinking both ways with signatures."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

pytest.importorskip("anthropic", reason="the anthropic SDK is not installed (extra: gengate[anthropic])")

import contract_checks as cc
import tool_contract
from fake_anthropic import API_KEY, ARGUMENT_FRAGMENT, FakeAnthropic
from gengate import errors
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationEnd,
    JsonSchemaConstraint,
    Reasoning,
    ReasoningControl,
    ReasoningEffort,
    Role,
    StoppingCriteria,
    StreamStart,
    StructuredOutput,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from gengate.providers.anthropic import AnthropicBackend
from pydantic import SecretStr
from tool_requests import (
    CLOCK,
    PARIS,
    WEATHER,
    ask,
    chat,
    deltas,
)

PING = Tool("ping")  # no parameters: a call takes only {}
SIGNATURE = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAnthropic]:
    yield from cc.serving(FakeAnthropic())


@pytest.fixture
async def build(fake: FakeAnthropic) -> AsyncIterator[Any]:
    fake.reset()
    made: list[AnthropicBackend] = []

    async def start(**overrides: Any) -> AnthropicBackend:
        opts: dict[str, Any] = {
            "model": "claude-test",
            "base_url": fake.server.base_url,
            "api_key": SecretStr(API_KEY),
            "timeout": 5.0,
            "max_retries": 0,
        } | overrides
        backend = AnthropicBackend("claude", AnthropicBackend.Options(**opts))
        await backend.start()
        made.append(backend)
        return backend

    yield start
    for backend in made:
        await backend.aclose()


def body(fake: FakeAnthropic, i: int = 0) -> dict[str, Any]:
    return dict(fake.server.requests[i].body)


def test_capabilities_declare_native_tools_and_reasoning() -> None:
    backend = AnthropicBackend("claude", AnthropicBackend.Options(model="c", api_key=SecretStr("k")))
    caps = backend.capabilities
    assert (caps.tools, caps.reasoning_control, caps.reasoning) == (Enforcement.NATIVE, True, True)


# --- the wire, out ----------------------------------------------------------------------------


async def test_tools_choice_and_disable_parallel_on_the_wire(build: Any, fake: FakeAnthropic) -> None:
    backend = await build()
    fake.calls.append([("get_weather", PARIS)])
    req = ask(WEATHER, CLOCK, tool_choice=ToolChoice(name="get_weather"), parallel_tool_calls=False)
    await backend.generate(req)
    sent = body(fake)
    assert sent["tools"] == [
        {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER.parameters},
        {"name": "get_time", "input_schema": CLOCK.parameters},
    ]
    assert sent["tool_choice"] == {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    cases = [
        (ToolChoice(ToolChoiceMode.AUTO), None, {"type": "auto"}),
        (ToolChoice(ToolChoiceMode.REQUIRED), None, {"type": "any"}),
        (ToolChoice(ToolChoiceMode.NONE), False, {"type": "none"}),  # none takes no parallel flag
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        (ToolChoice(ToolChoiceMode.REQUIRED), False, {"type": "any", "disable_parallel_tool_use": True}),
    ]
    for choice, parallel, wire in cases:
        fake.reset()
        if choice is None or choice.mode is not ToolChoiceMode.NONE:
            fake.calls.append([("get_weather", PARIS)])
        await backend.generate(ask(tool_choice=choice, parallel_tool_calls=parallel))
        assert body(fake)["tool_choice"] == wire
    fake.reset()
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(ask())
    assert "tool_choice" not in body(fake)  # unset: the API's default


async def test_no_tools_no_tool_or_thinking_fields(build: Any, fake: FakeAnthropic) -> None:
    backend = await build()
    result = await backend.generate(cc.prompt())
    assert not {"tools", "tool_choice", "thinking", "output_config"} & set(body(fake))
    assert result.enforcement == Enforcement.NONE


async def test_a_strict_tool_goes_strict_with_a_closed_schema(build: Any, fake: FakeAnthropic) -> None:
    backend = await build()
    strict = Tool(WEATHER.name, WEATHER.description, WEATHER.parameters, strict=True)
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(ask(strict))
    wire = body(fake)["tools"][0]
    assert wire["strict"] is True and wire["input_schema"]["additionalProperties"] is False
    properties = wire["input_schema"]["properties"]  # adapted by the SDK's transform_schema
    assert properties["city"] == {"type": "string"} and properties["unit"]["enum"] == ["C", "F"]
    loose = Tool(
        "lookup", parameters={"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}
    )
    fake.reset()
    fake.calls.append([("lookup", json.dumps({"n": 4}))])
    await backend.generate(ask(Tool(loose.name, parameters=loose.parameters, strict=True)))
    wire = body(fake)["tools"][0]  # `minimum` is not enforced by strict mode: sent as it is
    assert "strict" not in wire and wire["input_schema"] == loose.parameters


async def test_a_conversation_of_calls_results_and_thinking_on_the_wire(
    build: Any, fake: FakeAnthropic
) -> None:
    backend = await build()
    calls = (ToolCall("toolu_1", "get_weather", PARIS), ToolCall("toolu_2", "get_time", "{}"))
    history = (
        ChatMessage(Role.SYSTEM, (TextPart("Be brief."),)),
        ChatMessage(Role.USER, (TextPart("Weather and time in Paris?"),)),
        ChatMessage(
            Role.ASSISTANT,
            (TextPart("Let me look."),),
            tool_calls=calls,
            reasoning=Reasoning("Two tools needed.", (SIGNATURE, "redacted_thinking:ENCRYPTED")),
        ),
        ChatMessage(Role.TOOL, (TextPart('{"sky": "clear"}'),), tool_call_id="toolu_1"),
        ChatMessage(Role.TOOL, (TextPart("12:00"),), tool_call_id="toolu_2"),
        ChatMessage(Role.USER, (TextPart("Thanks, and tomorrow?"),)),
    )
    fake.answers.append("Clear at noon.")
    result = await backend.generate(ask(WEATHER, CLOCK, messages=history))
    sent = body(fake)
    assert sent["system"] == "Be brief."
    assert sent["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather and time in Paris?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Two tools needed.", "signature": SIGNATURE},
                {"type": "redacted_thinking", "data": "ENCRYPTED"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
            ],
        },
        {
            "role": "user",  # both results and the next question in one turn: roles alternate
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"sky": "clear"}'},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "12:00"},
                {"type": "text", "text": "Thanks, and tomorrow?"},
            ],
        },
    ]
    gen = result.generations[0]
    assert (gen.text, gen.tool_calls, gen.finish_reason) == ("Clear at noon.", (), FinishReason.STOP)


async def test_unsigned_reasoning_is_not_sent_back(build: Any, fake: FakeAnthropic) -> None:
    backend = await build()
    history = (
        ChatMessage(Role.USER, (TextPart("hi"),)),
        ChatMessage(Role.ASSISTANT, (TextPart("hello"),), reasoning=Reasoning("from another model")),
        ChatMessage(Role.USER, (TextPart("again"),)),
    )
    await backend.generate(chat(messages=history))
    assert body(fake)["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}


async def test_history_arguments_that_are_no_object_are_refused(build: Any, fake: FakeAnthropic) -> None:
    backend = await build()
    history = (
        ChatMessage(Role.USER, (TextPart("hi"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(ToolCall("toolu_1", "get_weather", "[1, 2]"),)),
        ChatMessage(Role.TOOL, (TextPart("sunny"),), tool_call_id="toolu_1"),
    )
    with pytest.raises(errors.InvalidArgument) as info:
        await backend.generate(ask(messages=history))
    assert [v.field for v in info.value.violations] == ["messages.messages[1].tool_calls[0].arguments_json"]
    assert fake.server.requests == []


# --- calls, in ----------------------------------------------------------------------------------


async def test_unary_calls_returned(build: Any, fake: FakeAnthropic) -> None:
    await tool_contract.check_unary_calls(await build(), fake, ("toolu_fake_1_0", "toolu_fake_1_1"))


async def test_stream_fragments_then_the_complete_calls_in_the_end_frame(
    build: Any, fake: FakeAnthropic
) -> None:
    backend = await build()
    arguments = json.dumps({"city": "Paris", "unit": "C"})
    fake.calls.append([("get_weather", arguments), ("ping", "")])  # ping streams no input at all
    events = await cc.collect(backend.generate_stream(ask(WEATHER, PING)))
    assert isinstance(events[0], StreamStart) and events[0].enforcement == Enforcement.NATIVE
    fragments = [f for d in deltas(events) for f in d.tool_calls]
    first = [f for f in fragments if f.index == 0]
    assert (first[0].id, first[0].name, first[0].arguments) == ("toolu_fake_1_0", "get_weather", "")
    assert len(first) == 1 + -(-len(arguments) // ARGUMENT_FRAGMENT)  # the fragments as sent
    assert all(f.id == "" and f.name == "" for f in first[1:])
    assert "".join(f.arguments for f in first) == arguments
    assert [(f.id, f.name, f.arguments) for f in fragments if f.index == 1] == [
        ("toolu_fake_1_1", "ping", ""),
        ("", "", "{}"),
    ]
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason == FinishReason.TOOL_CALLS
    assert end.tool_calls == (
        ToolCall("toolu_fake_1_0", "get_weather", arguments),
        ToolCall("toolu_fake_1_1", "ping", "{}"),
    )
    assert end.usage.output_tokens > 0


async def test_an_invalid_streamed_call_ends_the_stream_with_validation_failed(
    build: Any, fake: FakeAnthropic
) -> None:
    await tool_contract.check_invalid_stream_aborts(await build(), fake)


# --- validation and the bounded re-ask ---------------------------------------------------------------


async def test_bad_arguments_are_reasked_with_the_error_as_tool_results(
    build: Any, fake: FakeAnthropic
) -> None:
    backend = await build()
    fake.calls.extend([[("get_weather", json.dumps({"city": 3}))], [("get_weather", PARIS)]])
    result = await backend.generate(ask())
    assert len(fake.server.requests) == 2
    assert result.generations[0].tool_calls == (ToolCall("toolu_fake_2_0", "get_weather", PARIS),)
    first, second = body(fake, 0), body(fake, 1)
    assert second["tools"] == first["tools"] and second["messages"][:-2] == first["messages"]
    assistant, feedback = second["messages"][-2:]
    assert assistant == {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_fake_1_0", "name": "get_weather", "input": {"city": 3}}
        ],
    }
    assert feedback["role"] == "user"
    [answer] = feedback["content"]
    assert answer["type"] == "tool_result" and answer["tool_use_id"] == "toolu_fake_1_0"
    assert "not valid" in answer["content"] and "city" in answer["content"]


async def test_the_reask_sends_the_bad_turns_thinking_back_beside_its_call(
    build: Any, fake: FakeAnthropic
) -> None:
    backend = await build()
    fake.thinking = [("Paris, so the city is Paris.", SIGNATURE)]
    fake.calls.extend([[("get_weather", "{}")], [("get_weather", PARIS)]])
    await backend.generate(ask(reasoning=ReasoningControl(budget_tokens=2048)))
    assistant = body(fake, 1)["messages"][-2]
    assert assistant["content"][0] == {
        "type": "thinking",
        "thinking": "Paris, so the city is Paris.",
        "signature": SIGNATURE,
    }
    assert assistant["content"][1]["type"] == "tool_use"


async def test_reask_exhausted_is_validation_failed(build: Any, fake: FakeAnthropic) -> None:
    await tool_contract.check_reask_exhausted(await build(), fake)


async def test_a_tool_not_offered_and_parallel_calls_are_refused(build: Any, fake: FakeAnthropic) -> None:
    await tool_contract.check_not_offered_and_parallel_refused(await build(validation_retries=0), fake)


async def test_text_where_a_call_is_required_is_reasked_as_a_user_turn(
    build: Any, fake: FakeAnthropic
) -> None:
    said, feedback = await tool_contract.check_required_text_reasked(await build(), fake)
    assert said == {"role": "assistant", "content": [{"type": "text", "text": "It is sunny, I think."}]}
    assert feedback["role"] == "user" and "a tool call is required" in feedback["content"][0]["text"]


# --- thinking -----------------------------------------------------------------------------------------


async def test_thinking_controls_on_the_wire(build: Any, fake: FakeAnthropic) -> None:
    backend = await build()
    await backend.generate(cc.prompt(reasoning=ReasoningControl(budget_tokens=2048)))
    sent = body(fake)
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert sent["max_tokens"] == 2048 + 1024  # the default answer length after the budget
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    cases = [
        (ReasoningControl(enabled=True), {"type": "adaptive"}, None),
        (ReasoningControl(enabled=False), {"type": "disabled"}, None),
        (ReasoningControl(effort=ReasoningEffort.LOW), None, "low"),
        (ReasoningControl(enabled=True, effort=ReasoningEffort.HIGH), {"type": "adaptive"}, "high"),
    ]
    for control, thinking, effort in cases:
        fake.reset()
        fake.answers.append(json.dumps({"a": "x"}))
        structured = StructuredOutput(JsonSchemaConstraint(schema))
        await backend.generate(cc.prompt(reasoning=control, structured_output=structured))
        sent = body(fake)
        assert sent.get("thinking") == thinking
        assert sent["output_config"].get("effort") == effort
        assert sent["output_config"]["format"]["type"] == "json_schema"  # beside the effort
        assert sent["max_tokens"] == 1024


async def test_thinking_requests_anthropic_cannot_take_are_refused_before_sending(
    build: Any, fake: FakeAnthropic
) -> None:
    backend = await build()
    with pytest.raises(errors.InvalidArgument) as low:
        await backend.generate(cc.prompt(reasoning=ReasoningControl(budget_tokens=512)))
    assert [v.field for v in low.value.violations] == ["reasoning.budget_tokens"]
    over = cc.prompt(
        reasoning=ReasoningControl(budget_tokens=2048), stopping=StoppingCriteria(max_tokens=2048)
    )
    with pytest.raises(errors.InvalidArgument) as no_room:
        await backend.generate(over)
    assert [v.field for v in no_room.value.violations] == ["reasoning.budget_tokens"]
    assert "max_tokens" in no_room.value.message
    for choice in (ToolChoice(ToolChoiceMode.REQUIRED), ToolChoice(name="get_weather")):
        with pytest.raises(errors.Unimplemented) as forced:
            await backend.generate(ask(tool_choice=choice, reasoning=ReasoningControl(enabled=True)))
        assert forced.value.reason == "REASONING_UNSUPPORTED"
        assert [v.field for v in forced.value.violations] == ["tool_choice"]
    assert fake.server.requests == []


async def test_thinking_comes_back_unary_and_streamed_with_its_signature(
    build: Any, fake: FakeAnthropic
) -> None:
    backend = await build()
    fake.thinking = [("The user wants a greeting.", SIGNATURE)]
    fake.answers.extend(["Hello!", "Hello again!"])
    gen = (await backend.generate(chat(reasoning=ReasoningControl(budget_tokens=1024)))).generations[0]
    assert gen.reasoning == Reasoning("The user wants a greeting.", (SIGNATURE,))
    assert gen.text == "Hello!"
    events = await cc.collect(backend.generate_stream(chat()))
    assert "".join(d.reasoning for d in deltas(events)) == "The user wants a greeting."
    assert "".join(d.text for d in deltas(events)) == "Hello again!"
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.reasoning_signatures == (SIGNATURE,)


async def test_several_and_redacted_thinking_blocks_go_back_as_they_came(
    build: Any, fake: FakeAnthropic
) -> None:
    fake.thinking = [("First thought. ", "sigA"), ("Second thought.", "sigB")]
    fake.redacted = "OPAQUE"
    turn = await tool_contract.check_thinking_round_trip(
        await build(), fake, "First thought. Second thought."
    )
    assert turn["content"][:3] == [
        {"type": "thinking", "thinking": "First thought. ", "signature": "sigA"},
        {"type": "thinking", "thinking": "Second thought.", "signature": "sigB"},
        {"type": "redacted_thinking", "data": "OPAQUE"},
    ]
