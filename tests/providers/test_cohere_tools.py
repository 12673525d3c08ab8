"""Tool calling and thinking on Cohere, through the real `cohere` SDK (AsyncClientV2) against the
loopback v2 Chat API: the wire form of tools, tool choice, tool turns and thinking, calls and
tool plans returned (unary and streamed), validation with a bounded re-ask, and refusals."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

pytest.importorskip("cohere", reason="the cohere SDK is not installed (extra: gengate[cohere])")

import contract_checks as cc
import tool_contract
from fake_cohere import API_KEY, ARGUMENT_FRAGMENT, FakeCohere
from gengate import errors
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationEnd,
    ImagePart,
    Reasoning,
    ReasoningControl,
    ReasoningEffort,
    Role,
    StreamStart,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from gengate.providers.cohere import CohereBackend
from tool_requests import (
    CLOCK,
    PARIS,
    WEATHER,
    ask,
    chat,
    deltas,
)

PING = Tool("ping")  # no parameters: a call takes only {}
PLAN = "I will look that up."


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeCohere]:
    yield from cc.serving(FakeCohere())


@pytest.fixture
async def build(fake: FakeCohere) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        CohereBackend,
        "command",
        fake,
        model="command-test",
        base_url=fake.server.base_url,
        api_key=API_KEY,
        max_retries=0,
    ) as make:
        yield make


def body(fake: FakeCohere, i: int = 0) -> dict[str, Any]:
    return dict(fake.server.requests[i].body)


def wire_tool(t: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": t.name}
    if t.description:
        function["description"] = t.description
    function["parameters"] = t.parameters
    return {"type": "function", "function": function}


def test_capabilities_declare_native_tools_and_reasoning() -> None:
    caps = CohereBackend("command", CohereBackend.Options(model="c", api_key=API_KEY)).capabilities
    assert (caps.tools, caps.reasoning_control, caps.reasoning) == (Enforcement.NATIVE, True, True)


# --- the wire, out ----------------------------------------------------------------------------


async def test_tools_and_each_tool_choice_on_the_wire(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(ask(WEATHER, CLOCK))
    sent = body(fake)
    assert sent["tools"] == [wire_tool(WEATHER), wire_tool(CLOCK)]
    assert not {"tool_choice", "strict_tools"} & set(sent)  # auto is Cohere's default
    cases = [
        (ToolChoice(ToolChoiceMode.AUTO), None),
        (ToolChoice(ToolChoiceMode.REQUIRED), "REQUIRED"),
        (ToolChoice(ToolChoiceMode.NONE), "NONE"),
    ]
    for choice, wire in cases:
        fake.reset()
        if choice.mode is not ToolChoiceMode.NONE:
            fake.calls.append([("get_weather", PARIS)])
        await backend.generate(ask(WEATHER, CLOCK, tool_choice=choice))
        sent = body(fake)
        assert sent.get("tool_choice") == wire
        assert sent["tools"] == [wire_tool(WEATHER), wire_tool(CLOCK)]


async def test_a_named_tool_is_that_tool_alone_with_required(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    fake.calls.append([("get_time", "{}")])
    result = await backend.generate(ask(WEATHER, CLOCK, tool_choice=ToolChoice(name="get_time")))
    sent = body(fake)
    assert sent["tools"] == [wire_tool(CLOCK)] and sent["tool_choice"] == "REQUIRED"
    assert result.generations[0].tool_calls[0].name == "get_time"


async def test_parallel_calls_off_has_no_switch_and_is_validated(build: Any, fake: FakeCohere) -> None:
    backend = await build(validation_retries=0)
    fake.calls.append([("get_weather", PARIS), ("get_weather", PARIS)])
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask(parallel_tool_calls=False))
    assert "parallel_tool_calls is false" in info.value.message
    sent = body(fake)
    assert not {"parallel_tool_calls", "tool_choice"} & set(sent)
    fake.calls.append([("get_weather", PARIS), ("get_time", "{}")])
    result = await backend.generate(ask(WEATHER, CLOCK, parallel_tool_calls=True))
    assert [c.name for c in result.generations[0].tool_calls] == ["get_weather", "get_time"]


async def test_strict_tools_only_when_every_tool_takes_it(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    strict = Tool(WEATHER.name, WEATHER.description, WEATHER.parameters, strict=True)
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(ask(strict))
    assert body(fake)["strict_tools"] is True
    optional_only = Tool(CLOCK.name, parameters=CLOCK.parameters, strict=True)  # nothing required
    for tools in ((strict, CLOCK), (strict, optional_only)):
        fake.reset()
        fake.calls.append([("get_weather", PARIS)])
        await backend.generate(ask(*tools))
        assert "strict_tools" not in body(fake)


async def test_no_tools_no_tool_or_thinking_fields(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    result = await backend.generate(cc.prompt())
    assert not {"tools", "tool_choice", "strict_tools", "thinking"} & set(body(fake))
    assert result.enforcement == Enforcement.NONE


async def test_a_conversation_of_calls_results_and_thinking_on_the_wire(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    calls = (ToolCall("call_1", "get_weather", PARIS), ToolCall("call_2", "get_time", ""))
    history = (
        ChatMessage(Role.SYSTEM, (TextPart("Be brief."),)),
        ChatMessage(Role.USER, (TextPart("Weather and time in Paris?"),)),
        ChatMessage(
            Role.ASSISTANT,
            (TextPart("Let me look."),),
            tool_calls=calls,
            reasoning=Reasoning("Two tools needed."),
        ),
        ChatMessage(Role.TOOL, (TextPart('{"sky": "clear"}'),), tool_call_id="call_1"),
        ChatMessage(Role.TOOL, (TextPart("12:00"),), tool_call_id="call_2"),
        ChatMessage(Role.ASSISTANT, (TextPart("Clear, noon."),), reasoning=Reasoning("Both came.")),
        ChatMessage(Role.USER, (TextPart("Thanks, and tomorrow?"),)),
    )
    fake.answers.append("Clear again.")
    result = await backend.generate(ask(WEATHER, CLOCK, messages=history))
    assert body(fake)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
            "tool_plan": "Let me look.",
            "content": [{"type": "thinking", "thinking": "Two tools needed."}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Both came."},
                {"type": "text", "text": "Clear, noon."},
            ],
        },
        {"role": "user", "content": "Thanks, and tomorrow?"},
    ]
    gen = result.generations[0]
    assert (gen.text, gen.tool_calls, gen.finish_reason) == ("Clear again.", (), FinishReason.STOP)


# --- calls, in ----------------------------------------------------------------------------------


async def test_unary_calls_returned_with_the_plan_as_text(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    fake.calls.append([("get_weather", PARIS), ("get_time", json.dumps({"zone": "CET"}))])
    result = await backend.generate(ask(WEATHER, CLOCK))
    gen = result.generations[0]
    assert gen.tool_calls == (
        ToolCall("call_fake_1_0", "get_weather", PARIS),
        ToolCall("call_fake_1_1", "get_time", json.dumps({"zone": "CET"})),
    )
    assert (gen.finish_reason, gen.text, gen.reasoning) == (FinishReason.TOOL_CALLS, PLAN, None)
    assert result.enforcement == Enforcement.NATIVE
    assert result.usage.output_tokens > 0


async def test_a_call_without_arguments_is_an_empty_object(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    fake.calls.append([("ping", "")])
    gen = (await backend.generate(ask(PING))).generations[0]
    assert gen.tool_calls == (ToolCall("call_fake_1_0", "ping", "{}"),)


async def test_stream_fragments_then_the_complete_calls_in_the_end_frame(
    build: Any, fake: FakeCohere
) -> None:
    backend = await build()
    arguments = json.dumps({"city": "Paris", "unit": "C"})
    fake.calls.append([("get_weather", arguments), ("ping", "")])  # ping streams no arguments at all
    events = await cc.collect(backend.generate_stream(ask(WEATHER, PING)))
    assert isinstance(events[0], StreamStart) and events[0].enforcement == Enforcement.NATIVE
    assert "".join(d.text for d in deltas(events)) == PLAN
    fragments = [f for d in deltas(events) for f in d.tool_calls]
    first = [f for f in fragments if f.index == 0]
    assert (first[0].id, first[0].name, first[0].arguments) == (
        "call_fake_1_0",
        "get_weather",
        arguments[:ARGUMENT_FRAGMENT],  # tool-call-start carries the first fragment
    )
    assert len(first) == -(-len(arguments) // ARGUMENT_FRAGMENT)
    assert all(f.id == "" and f.name == "" for f in first[1:])
    assert "".join(f.arguments for f in first) == arguments
    assert [(f.id, f.name, f.arguments) for f in fragments if f.index == 1] == [
        ("call_fake_1_1", "ping", ""),
        ("", "", "{}"),
    ]
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason == FinishReason.TOOL_CALLS
    assert end.tool_calls == (
        ToolCall("call_fake_1_0", "get_weather", arguments),
        ToolCall("call_fake_1_1", "ping", "{}"),
    )
    assert end.usage.output_tokens > 0


async def test_an_invalid_streamed_call_ends_the_stream_with_validation_failed(
    build: Any, fake: FakeCohere
) -> None:
    await tool_contract.check_invalid_stream_aborts(await build(), fake)


# --- validation and the bounded re-ask ---------------------------------------------------------------


async def test_malformed_arguments_are_reasked_with_the_error_as_tool_results(
    build: Any, fake: FakeCohere
) -> None:
    backend = await build()
    fake.calls.extend([[("get_weather", '{"city": "Par')], [("get_weather", PARIS)]])
    result = await backend.generate(ask())
    assert len(fake.server.requests) == 2
    assert result.generations[0].tool_calls == (ToolCall("call_fake_2_0", "get_weather", PARIS),)
    first, second = body(fake, 0), body(fake, 1)
    assert second["tools"] == first["tools"] and second["messages"][:-2] == first["messages"]
    assistant, feedback = second["messages"][-2:]
    assert assistant == {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_fake_1_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Par'},
            }
        ],
        "tool_plan": PLAN,
    }
    assert feedback["role"] == "tool" and feedback["tool_call_id"] == "call_fake_1_0"
    assert "not valid" in feedback["content"] and "JSON" in feedback["content"]


async def test_reask_exhausted_is_validation_failed(build: Any, fake: FakeCohere) -> None:
    await tool_contract.check_reask_exhausted(await build(), fake)


async def test_a_tool_not_offered_is_reasked_then_accepted(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    fake.calls.extend([[("delete_everything", "{}")], [("get_weather", PARIS)]])
    result = await backend.generate(ask())
    assert result.generations[0].tool_calls[0].name == "get_weather"
    feedback = body(fake, 1)["messages"][-1]
    assert (
        feedback["role"] == "tool"
        and "'delete_everything', which is not an offered tool" in feedback["content"]
    )


async def test_text_where_a_call_is_required_is_reasked_as_a_user_turn(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    fake.calls.extend([[], [("get_weather", PARIS)]])  # a text first, then the call
    fake.answers.append("It is sunny, I think.")
    result = await backend.generate(ask(tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    assert result.generations[0].tool_calls[0].arguments == PARIS
    said, feedback = body(fake, 1)["messages"][-2:]
    assert said == {"role": "assistant", "content": "It is sunny, I think."}
    assert feedback["role"] == "user" and "a tool call is required" in feedback["content"]


# --- thinking -----------------------------------------------------------------------------------------


async def test_thinking_controls_on_the_wire(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    cases = [
        (ReasoningControl(budget_tokens=2048), {"type": "enabled", "token_budget": 2048}),
        (ReasoningControl(enabled=True), {"type": "enabled"}),
        (ReasoningControl(enabled=True, budget_tokens=512), {"type": "enabled", "token_budget": 512}),
        (ReasoningControl(enabled=False), {"type": "disabled"}),
    ]
    for control, thinking in cases:
        fake.reset()
        await backend.generate(cc.prompt(reasoning=control))
        assert body(fake)["thinking"] == thinking


async def test_an_effort_level_is_refused_naming_the_field(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(cc.prompt(reasoning=ReasoningControl(effort=ReasoningEffort.HIGH)))
    assert info.value.reason == "REASONING_UNSUPPORTED"
    assert [v.field for v in info.value.violations] == ["reasoning.effort"]
    assert fake.server.requests == []


async def test_thinking_comes_back_unary_and_streamed(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    fake.thinking = "The user wants a greeting."
    fake.answers.extend(["Hello!", "Hello again!"])
    gen = (await backend.generate(chat(reasoning=ReasoningControl(enabled=True)))).generations[0]
    assert (gen.reasoning, gen.text) == (Reasoning("The user wants a greeting."), "Hello!")
    events = await cc.collect(backend.generate_stream(chat()))
    assert "".join(d.reasoning for d in deltas(events)) == "The user wants a greeting."
    assert "".join(d.text for d in deltas(events)) == "Hello again!"
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.reasoning_signatures == ()


async def test_the_reask_sends_the_bad_turns_thinking_back_beside_its_call(
    build: Any, fake: FakeCohere
) -> None:
    backend = await build()
    fake.thinking = "Paris, so the city is Paris."
    fake.calls.extend([[("get_weather", "{}")], [("get_weather", PARIS)]])
    result = await backend.generate(ask(reasoning=ReasoningControl(budget_tokens=1024)))
    assert result.generations[0].reasoning == Reasoning("Paris, so the city is Paris.")
    assistant = body(fake, 1)["messages"][-2]
    assert assistant["content"] == [{"type": "thinking", "thinking": "Paris, so the city is Paris."}]
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}


async def test_an_image_in_a_tool_result_is_refused_naming_the_message(build: Any, fake: FakeCohere) -> None:
    backend = await build()
    history = (
        ChatMessage(Role.USER, (TextPart("What is on the map?"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(ToolCall("call_1", "get_weather", PARIS),)),
        ChatMessage(Role.TOOL, (ImagePart(url="https://example.com/map.png"),), tool_call_id="call_1"),
    )
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(ask(messages=history))
    assert info.value.reason == "TOOLS_UNSUPPORTED"
    assert [v.field for v in info.value.violations] == ["messages.messages[2].content"]
    assert fake.server.requests == []
