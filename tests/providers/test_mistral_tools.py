"""Tool calling and thinking on Mistral, through the real `mistralai` SDK against the loopback
chat API: the wire form of tools, tool choice, the parallel switch and tool turns (call ids
mapped to Mistral's nine characters), calls returned (unary and streamed), validation with a
bounded re-ask, reasoning_effort, and thinking chunks both ways."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

pytest.importorskip("mistralai", reason="the mistralai SDK is not installed (extra: gengate[mistral])")

import contract_checks as cc
import tool_contract
from fake_mistral import API_KEY, ARGUMENT_FRAGMENT, FakeMistral
from gengate import errors
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationEnd,
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
from gengate.providers import mistral_wire
from gengate.providers.mistral import MistralBackend
from mistral_bytes import same_bytes_as_the_sdk  # noqa: F401  (autouse: every body checked)
from pydantic import SecretStr
from tool_requests import CLOCK, PARIS, WEATHER, ask, chat, deltas

NINE = re.compile(r"[A-Za-z0-9]{9}")


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeMistral]:
    yield from cc.serving(FakeMistral())


@pytest.fixture
async def make(fake: FakeMistral) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        MistralBackend,
        "mistral",
        fake,
        model="mistral-test",
        base_url=fake.server.base_url,
        api_key=API_KEY,
        max_retries=0,
    ) as build:
        yield build


def body(fake: FakeMistral, i: int = 0) -> dict[str, Any]:
    return dict(fake.server.requests[i].body)


def test_capabilities_declare_native_tools_and_reasoning() -> None:
    backend = MistralBackend("m", MistralBackend.Options(model="m", api_key=SecretStr("k")))
    caps = backend.capabilities
    assert (caps.tools, caps.reasoning_control, caps.reasoning) == (Enforcement.NATIVE, True, True)


def test_call_ids_mapped_to_nine_letters_and_digits_stably() -> None:
    assert mistral_wire.call_id("abcDEF123") == "abcDEF123"  # Mistral's own: as it is
    made = [mistral_wire.call_id(i) for i in ("call_0fypS1hVX", "toolu_01A", "", "abcDEF12")]
    assert all(NINE.fullmatch(m) for m in made) and len(set(made)) == 4
    assert mistral_wire.call_id("call_0fypS1hVX") == made[0]  # the same on every turn


# --- the wire, out ----------------------------------------------------------------------------


async def test_tools_each_choice_and_the_parallel_switch_on_the_wire(
    make: cc.Make, fake: FakeMistral
) -> None:
    backend = await make()
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(
        ask(WEATHER, CLOCK, tool_choice=ToolChoice(name="get_weather"), parallel_tool_calls=False)
    )
    sent = body(fake)
    assert sent["tools"] == tool_contract.FUNCTION_TOOLS
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert sent["parallel_tool_calls"] is False
    cases = [
        (ToolChoice(ToolChoiceMode.AUTO), True, "auto"),
        (ToolChoice(ToolChoiceMode.REQUIRED), None, "any"),
        (ToolChoice(ToolChoiceMode.NONE), None, "none"),
    ]
    for choice, parallel, wire in cases:
        fake.reset()
        if choice.mode is not ToolChoiceMode.NONE:
            fake.calls.append([("get_weather", PARIS)])
        await backend.generate(ask(tool_choice=choice, parallel_tool_calls=parallel))
        assert body(fake)["tool_choice"] == wire
        assert body(fake).get("parallel_tool_calls") is parallel
    fake.reset()
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(ask())
    assert not {"tool_choice", "parallel_tool_calls"} & set(body(fake))  # unset: the API's default


async def test_a_strict_tool_asks_strict_mode_with_its_schema_as_it_is(
    make: cc.Make, fake: FakeMistral
) -> None:
    backend = await make()
    strict = Tool(WEATHER.name, WEATHER.description, WEATHER.parameters, strict=True)
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(ask(strict))
    function = body(fake)["tools"][0]["function"]
    assert function["strict"] is True and function["parameters"] == WEATHER.parameters


async def test_no_tools_no_tool_or_reasoning_fields(make: cc.Make, fake: FakeMistral) -> None:
    backend = await make()
    result = await backend.generate(cc.prompt())
    assert not {"tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"} & set(body(fake))
    assert result.enforcement == Enforcement.NONE


async def test_a_conversation_of_calls_results_and_thinking_on_the_wire(
    make: cc.Make, fake: FakeMistral
) -> None:
    backend = await make()
    calls = (ToolCall("abcDEF123", "get_weather", PARIS), ToolCall("call_0fypS1hVXzz", "get_time", "{}"))
    mapped = mistral_wire.call_id("call_0fypS1hVXzz")
    history = (
        ChatMessage(Role.SYSTEM, (TextPart("Be brief."),)),
        ChatMessage(Role.USER, (TextPart("Weather and time in Paris?"),)),
        ChatMessage(
            Role.ASSISTANT,
            (TextPart("Let me look."),),
            tool_calls=calls,
            reasoning=Reasoning("Two tools needed.", ("sigA",)),
        ),
        ChatMessage(Role.TOOL, (TextPart('{"sky": "clear"}'),), tool_call_id="abcDEF123"),
        ChatMessage(Role.TOOL, (TextPart("12:00"),), name="get_time", tool_call_id="call_0fypS1hVXzz"),
        ChatMessage(Role.ASSISTANT, (TextPart("Clear, noon."),), reasoning=Reasoning("Easy.")),
        ChatMessage(Role.USER, (TextPart("And tomorrow?"),)),
    )
    fake.answers.append("Clear again.")
    result = await backend.generate(ask(WEATHER, CLOCK, messages=history))
    assert body(fake)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "thinking",
                    "thinking": [{"type": "text", "text": "Two tools needed."}],
                    "signature": "sigA",
                },
                {"type": "text", "text": "Let me look."},
            ],
            "tool_calls": [
                {
                    "id": "abcDEF123",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": PARIS},
                    "index": 0,
                },
                {
                    "id": mapped,
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                    "index": 1,
                },
            ],
            "prefix": False,
        },
        {"role": "tool", "tool_call_id": "abcDEF123", "name": "get_weather", "content": '{"sky": "clear"}'},
        {"role": "tool", "tool_call_id": mapped, "name": "get_time", "content": "12:00"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": [{"type": "text", "text": "Easy."}]},
                {"type": "text", "text": "Clear, noon."},
            ],
            "prefix": False,
        },
        {"role": "user", "content": "And tomorrow?"},
    ]
    gen = result.generations[0]
    assert (gen.text, gen.tool_calls, gen.finish_reason) == ("Clear again.", (), FinishReason.STOP)


async def test_an_unmapped_id_is_what_mistral_refuses(fake: FakeMistral, make: cc.Make) -> None:
    """The fake holds Mistral's rule: the mapping above is what keeps a foreign id from a 400."""
    backend = await make()
    fake.server.reset()
    history = (
        ChatMessage(Role.USER, (TextPart("hi"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(ToolCall("call_0fypS1hVX", "get_weather", PARIS),)),
        ChatMessage(Role.TOOL, (TextPart("sunny"),), tool_call_id="call_0fypS1hVX"),
    )
    await backend.generate(ask(messages=history))  # accepted: the id went mapped
    sent = body(fake)["messages"]
    assert sent[1]["tool_calls"][0]["id"] == sent[2]["tool_call_id"] != "call_0fypS1hVX"
    unmapped = [{"role": "tool", "tool_call_id": "call_0fypS1hVX", "content": "sunny"}]
    with pytest.raises(Exception, match="must be a-z, A-Z, 0-9, with a length of 9"):
        await backend.client.chat.complete_async(model="mistral-test", messages=unmapped)


# --- calls, in ----------------------------------------------------------------------------------


async def test_unary_calls_returned(make: cc.Make, fake: FakeMistral) -> None:
    await tool_contract.check_unary_calls(await make(), fake, ("r0001c000", "r0001c001"))


async def test_arguments_sent_as_an_object_come_back_as_json_text(make: cc.Make, fake: FakeMistral) -> None:
    backend = await make()
    fake.object_arguments = True
    fake.calls.extend([[("get_weather", json.dumps({"city": "Paris", "unit": "C"}))]] * 2)
    gen = (await backend.generate(ask())).generations[0]
    assert json.loads(gen.tool_calls[0].arguments) == {"city": "Paris", "unit": "C"}
    events = await cc.collect(backend.generate_stream(ask()))
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.tool_calls[0].arguments == gen.tool_calls[0].arguments


async def test_stream_whole_calls_then_the_same_calls_in_the_end_frame(
    make: cc.Make, fake: FakeMistral
) -> None:
    backend = await make()
    fake.calls.append([("get_weather", PARIS), ("get_time", json.dumps({"zone": "CET"}))])
    events = await cc.collect(backend.generate_stream(ask(WEATHER, CLOCK)))
    assert isinstance(events[0], StreamStart) and events[0].enforcement == Enforcement.NATIVE
    fragments = [f for d in deltas(events) for f in d.tool_calls]
    assert [(f.index, f.id, f.name) for f in fragments] == [
        (0, "r0001c000", "get_weather"),
        (1, "r0001c001", "get_time"),
    ]
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason == FinishReason.TOOL_CALLS
    assert end.tool_calls == tuple(ToolCall(f.id, f.name, f.arguments) for f in fragments)
    assert end.usage.output_tokens > 0


async def test_stream_call_pieces_assemble_into_the_end_frames_call(make: cc.Make, fake: FakeMistral) -> None:
    backend = await make()
    fake.split_calls = True
    arguments = json.dumps({"city": "Paris", "unit": "C"})
    fake.calls.append([("get_weather", arguments), ("get_time", "{}")])
    events = await cc.collect(backend.generate_stream(ask(WEATHER, CLOCK)))
    fragments = [f for d in deltas(events) for f in d.tool_calls]
    first = [f for f in fragments if f.index == 0]
    assert len(first) == -(-len(arguments) // ARGUMENT_FRAGMENT)  # one per piece sent
    assert (first[0].id, first[0].name) == ("r0001c000", "get_weather")
    assert all(f.id == "" and f.name == "" for f in first[1:])  # repeated id and name: said once
    assert "".join(f.arguments for f in first) == arguments
    end = events[-1]
    assert isinstance(end, GenerationEnd)
    assert end.tool_calls == (
        ToolCall("r0001c000", "get_weather", arguments),
        ToolCall("r0001c001", "get_time", "{}"),
    )


async def test_an_invalid_streamed_call_ends_the_stream_with_validation_failed(
    make: cc.Make, fake: FakeMistral
) -> None:
    await tool_contract.check_invalid_stream_aborts(await make(), fake)


# --- validation and the bounded re-ask ---------------------------------------------------------------


async def test_bad_arguments_are_reasked_with_the_error_as_tool_results(
    make: cc.Make, fake: FakeMistral
) -> None:
    backend = await make()
    fake.calls.extend([[("get_weather", '{"city": 3')], [("get_weather", PARIS)]])
    result = await backend.generate(ask())
    assert len(fake.server.requests) == 2
    assert result.generations[0].tool_calls == (ToolCall("r0002c000", "get_weather", PARIS),)
    first, second = body(fake, 0), body(fake, 1)
    assert second["tools"] == first["tools"] and second["messages"][:-2] == first["messages"]
    assistant, answer = second["messages"][-2:]
    assert assistant == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "r0001c000",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": 3'},
                "index": 0,
            }
        ],
        "prefix": False,
    }
    assert (answer["role"], answer["tool_call_id"], answer["name"]) == ("tool", "r0001c000", "get_weather")
    assert "not valid" in answer["content"] and "JSON" in answer["content"]


async def test_reask_exhausted_is_validation_failed(make: cc.Make, fake: FakeMistral) -> None:
    await tool_contract.check_reask_exhausted(await make(), fake)


async def test_a_tool_not_offered_and_parallel_calls_are_refused(make: cc.Make, fake: FakeMistral) -> None:
    await tool_contract.check_not_offered_and_parallel_refused(await make(validation_retries=0), fake)


async def test_a_tool_not_offered_is_reasked_then_answered(make: cc.Make, fake: FakeMistral) -> None:
    backend = await make()
    fake.calls.extend([[("delete_everything", "{}")], [("get_weather", PARIS)]])
    result = await backend.generate(ask())
    assert result.generations[0].tool_calls[0].name == "get_weather"
    answer = body(fake, 1)["messages"][-1]
    assert answer["role"] == "tool" and "delete_everything" in answer["content"]


async def test_text_where_a_call_is_required_is_reasked_as_a_user_turn(
    make: cc.Make, fake: FakeMistral
) -> None:
    said, feedback = await tool_contract.check_required_text_reasked(await make(), fake)
    assert said == {"role": "assistant", "content": "It is sunny, I think.", "prefix": False}
    assert feedback["role"] == "user" and "a tool call is required" in feedback["content"]


# --- reasoning -----------------------------------------------------------------------------------------


async def test_reasoning_effort_on_the_wire(make: cc.Make, fake: FakeMistral) -> None:
    backend = await make()
    for effort in ReasoningEffort:
        fake.reset()
        await backend.generate(cc.prompt(reasoning=ReasoningControl(effort=effort)))
        assert body(fake)["reasoning_effort"] == effort.value


async def test_a_reasoning_switch_or_budget_is_refused_naming_the_field(
    make: cc.Make, fake: FakeMistral
) -> None:
    backend = await make()
    for control, field in (
        (ReasoningControl(enabled=True), "reasoning.enabled"),
        (ReasoningControl(enabled=False, effort=ReasoningEffort.LOW), "reasoning.enabled"),
        (ReasoningControl(budget_tokens=2048), "reasoning.budget_tokens"),
    ):
        with pytest.raises(errors.Unimplemented) as info:
            await backend.generate(cc.prompt(reasoning=control))
        assert info.value.reason == "REASONING_UNSUPPORTED"
        assert [v.field for v in info.value.violations] == [field]
    assert fake.server.requests == []


async def test_thinking_comes_back_unary_and_streamed(make: cc.Make, fake: FakeMistral) -> None:
    backend = await make()
    fake.thinking = [("The user wants a greeting.", "")]
    fake.answers.extend(["Hello!", "Hello again!"])
    gen = (await backend.generate(chat(reasoning=ReasoningControl(effort=ReasoningEffort.HIGH)))).generations[
        0
    ]
    assert (gen.reasoning, gen.text) == (Reasoning("The user wants a greeting."), "Hello!")
    events = await cc.collect(backend.generate_stream(chat()))
    assert "".join(d.reasoning for d in deltas(events)) == "The user wants a greeting."
    assert "".join(d.text for d in deltas(events)) == "Hello again!"
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.reasoning_signatures == ()


async def test_signed_thinking_chunks_come_back_and_go_back_as_they_came(
    make: cc.Make, fake: FakeMistral
) -> None:
    fake.thinking = [("First thought. ", "sigA"), ("Second thought.", "sigB")]
    turn = await tool_contract.check_thinking_round_trip(await make(), fake, "First thought. Second thought.")
    assert turn["content"] == [
        {"type": "thinking", "thinking": [{"type": "text", "text": "First thought. "}], "signature": "sigA"},
        {"type": "thinking", "thinking": [{"type": "text", "text": "Second thought."}], "signature": "sigB"},
    ]


async def test_the_reask_sends_the_bad_turns_thinking_back_beside_its_call(
    make: cc.Make, fake: FakeMistral
) -> None:
    backend = await make()
    fake.thinking = [("Paris, so the city is Paris.", "")]
    fake.calls.extend([[("get_weather", "{}")], [("get_weather", PARIS)]])
    await backend.generate(ask(reasoning=ReasoningControl(effort=ReasoningEffort.MEDIUM)))
    assistant = body(fake, 1)["messages"][-2]
    assert assistant["content"] == [
        {"type": "thinking", "thinking": [{"type": "text", "text": "Paris, so the city is Paris."}]}
    ]
    assert assistant["tool_calls"][0]["id"] == "r0001c000"
