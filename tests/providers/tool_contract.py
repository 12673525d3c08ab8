"""Tool-calling checks every native provider passes the same way (the validation the base does
on whatever the provider returned), driven through a fake that scripts calls as one list of
(name, arguments JSON text) pairs per answer (`fake.calls`) and records every request; then the
checks of the chat-completions tool wire itself, shared by the providers that speak it (the
OpenAI family, TGI, LiteLLM): tools and choice out, the re-ask's turns, a round trip."""

from __future__ import annotations

import json
from typing import Any, Protocol

import contract_checks as cc
import pytest
from fakehttp import FakeServer
from gengate import errors
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationEnd,
    Reasoning,
    ReasoningControl,
    Role,
    StreamEvent,
    StreamStart,
    TextPart,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
)
from tool_requests import CLOCK, PARIS, WEATHER, ask, chat, deltas

# WEATHER and CLOCK as chat-completions `tools` (OpenAI's wire, and Mistral's).
FUNCTION_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER.parameters,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK.parameters}},
]
ZONE = '{"zone": "CET"}'


class ScriptedCalls(Protocol):
    calls: list[list[tuple[str, str]]]
    answers: list[str]
    server: FakeServer

    def reset(self) -> None: ...


async def check_unary_calls(backend: Any, fake: ScriptedCalls, ids: tuple[str, str]) -> None:
    """Two calls answered come back as they were made (ids as the provider gave them), finish
    reason TOOL_CALLS, no text, NATIVE, with usage."""
    fake.calls.append([("get_weather", PARIS), ("get_time", ZONE)])
    result = await backend.generate(ask(WEATHER, CLOCK))
    gen = result.generations[0]
    assert gen.tool_calls == (ToolCall(ids[0], "get_weather", PARIS), ToolCall(ids[1], "get_time", ZONE))
    assert (gen.finish_reason, gen.text) == (FinishReason.TOOL_CALLS, "")
    assert result.enforcement == Enforcement.NATIVE
    assert result.usage.output_tokens > 0


async def check_invalid_stream_aborts(backend: Any, fake: ScriptedCalls) -> None:
    """A streamed call that fails validation ends the stream with Aborted VALIDATION_FAILED after
    its fragments went out, and no end frame: a stream is never re-asked."""
    fake.calls.append([("get_weather", '{"city": "Paris", "unit": "K"}')])
    events: list[StreamEvent] = []
    with pytest.raises(errors.Aborted) as info:
        async for event in backend.generate_stream(ask()):
            events.append(event)
    assert info.value.reason == "VALIDATION_FAILED"
    assert deltas(events) and not any(isinstance(e, GenerationEnd) for e in events)
    assert len(fake.server.requests) == 1


async def check_reask_exhausted(backend: Any, fake: ScriptedCalls) -> None:
    """Arguments that stay invalid: the first try and validation_retries (2) re-asks, then
    Aborted VALIDATION_FAILED naming the tool."""
    fake.calls.extend([[("get_weather", '{"town": "Paris"}')]] * 5)
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask())
    assert info.value.reason == "VALIDATION_FAILED"
    assert "3 tries" in info.value.message and "get_weather" in info.value.message
    assert len(fake.server.requests) == 3


async def check_not_offered_and_parallel_refused(backend: Any, fake: ScriptedCalls) -> None:
    """With no re-ask allowed (validation_retries 0): a tool not offered, and two calls where
    parallel_tool_calls is false, are Aborted after one request each."""
    fake.calls.append([("delete_everything", "{}")])
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask())
    assert "'delete_everything', which is not an offered tool" in info.value.message
    fake.calls.append([("get_weather", PARIS), ("get_weather", PARIS)])
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask(parallel_tool_calls=False))
    assert "parallel_tool_calls is false" in info.value.message
    assert len(fake.server.requests) == 2


async def check_required_text_reasked(backend: Any, fake: ScriptedCalls) -> tuple[Any, Any]:
    """A text where a call is required is re-asked, then the call is returned; gives the re-ask's
    last two wire messages (the text said, the feedback) for the provider's own assertions."""
    fake.calls.extend([[], [("get_weather", PARIS)]])  # a text first, then the call
    fake.answers.append("It is sunny, I think.")
    result = await backend.generate(ask(tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    assert result.generations[0].tool_calls[0].arguments == PARIS
    assert len(fake.server.requests) == 2
    said, feedback = fake.server.requests[-1].body["messages"][-2:]
    return said, feedback


async def check_thinking_round_trip(backend: Any, fake: ScriptedCalls, text: str) -> Any:
    """The fake's scripted thinking (whose texts join to `text`) beside a call: the unary and the
    streamed turn carry the same reasoning and signatures; sent back in a chat with the call's
    result, it gives that assistant turn's wire form for the provider's own assertions."""
    fake.calls.extend([[("get_weather", PARIS)], [("get_weather", PARIS)]])
    unary = (await backend.generate(ask())).generations[0]
    events = await cc.collect(backend.generate_stream(ask()))
    end = events[-1]
    assert isinstance(end, GenerationEnd)
    assert isinstance(unary.reasoning, Reasoning) and unary.reasoning.text == text
    assert end.reasoning_signatures == unary.reasoning.signatures  # the stream says the same
    assert "".join(d.reasoning for d in deltas(events)) == text
    fake.reset()
    history = (
        ChatMessage(Role.USER, (TextPart("Weather in Paris?"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=unary.tool_calls, reasoning=unary.reasoning),
        ChatMessage(Role.TOOL, (TextPart("sunny"),), tool_call_id=unary.tool_calls[0].id),
    )
    await backend.generate(ask(messages=history))
    return fake.server.requests[-1].body["messages"][1]


# --- the chat-completions tool wire (OpenAI family, TGI, LiteLLM) ----------------------------

SKY = '{"sky": "clear"}'


def wire_call(call_id: str, arguments: str = PARIS, name: str = "get_weather") -> dict[str, Any]:
    """One call as an assistant turn's `tool_calls` entry."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


async def check_tools_on_the_wire(backend: Any, fake: ScriptedCalls, *, parallel: bool) -> None:
    """Tools, a named choice and each mode as sent; the parallel switch sent exactly when the
    provider has one (`parallel`); none of it on a request without tools."""
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(
        ask(WEATHER, CLOCK, tool_choice=ToolChoice(name="get_weather"), parallel_tool_calls=False)
    )
    body = fake.server.requests[0].body
    assert body["tools"] == FUNCTION_TOOLS
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body.get("parallel_tool_calls") is (False if parallel else None)
    for mode in ("auto", "none", "required"):
        fake.reset()
        if mode != "none":
            fake.calls.append([("get_weather", PARIS)])
        await backend.generate(ask(tool_choice=ToolChoice(ToolChoiceMode(mode))))
        assert fake.server.requests[0].body["tool_choice"] == mode
        assert "parallel_tool_calls" not in fake.server.requests[0].body  # unset: the API's default
    fake.reset()
    await backend.generate(chat())
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(fake.server.requests[0].body)


async def check_reask(backend: Any, fake: ScriptedCalls, call_id: str) -> None:
    """Bad arguments are asked again with the same tools: the bad call in an assistant turn
    (no text), then a tool result answering its id with the error; the good call comes back."""
    bad = json.dumps({"city": 3})
    fake.calls.extend([[("get_weather", bad)], [("get_weather", PARIS)]])
    result = await backend.generate(ask())
    assert json.loads(result.generations[0].tool_calls[0].arguments) == {"city": "Paris"}
    first, second = (r.body for r in fake.server.requests)
    assert second["tools"] == first["tools"]
    assert second["messages"][:-2] == first["messages"]
    assistant, answer = second["messages"][-2:]
    assert assistant["role"] == "assistant" and not assistant.get("content")
    assert assistant["tool_calls"] == [wire_call(call_id, bad)]
    assert answer["role"] == "tool" and answer["tool_call_id"] == call_id
    assert "not valid" in answer["content"] and "city" in answer["content"]


async def check_round_trip(backend: Any, fake: ScriptedCalls, call_id: str) -> None:
    """A call and its result in the chat go out as the assistant's call and a tool message."""
    history = (
        ChatMessage(Role.USER, (TextPart("Weather in Paris?"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(ToolCall(call_id, "get_weather", PARIS),)),
        ChatMessage(Role.TOOL, (TextPart(SKY),), tool_call_id=call_id),
    )
    fake.answers.append("Clear skies in Paris.")
    result = await backend.generate(ask(messages=history))
    user, assistant, tool = fake.server.requests[0].body["messages"]
    assert user == {"role": "user", "content": "Weather in Paris?"}
    assert assistant["role"] == "assistant" and not assistant.get("content")
    assert assistant["tool_calls"] == [wire_call(call_id)]
    assert tool == {"role": "tool", "tool_call_id": call_id, "content": SKY}
    gen = result.generations[0]
    assert (gen.text, gen.tool_calls, gen.finish_reason) == ("Clear skies in Paris.", (), FinishReason.STOP)


async def check_reasoning_out(backend: Any, fake: Any) -> None:
    """The model's reasoning (the fake's `reasoning`) comes back beside the answer, unary and
    streamed."""
    fake.reasoning = "The user wants the weather."
    fake.answers.extend(["Sunny.", "Sunny again."])
    gen = (await backend.generate(chat())).generations[0]
    assert gen.reasoning is not None and gen.reasoning.text == "The user wants the weather."
    assert gen.text == "Sunny."
    events = await cc.collect(backend.generate_stream(chat()))
    assert "".join(d.reasoning for d in deltas(events)) == "The user wants the weather."
    assert "".join(d.text for d in deltas(events)) == "Sunny again."


async def check_reasoning_refused(backend: Any, refused: dict[str, ReasoningControl]) -> None:
    """Each control (by the field it sets) is refused REASONING_UNSUPPORTED naming that field."""
    for field, control in refused.items():
        with pytest.raises(errors.Unimplemented) as info:
            await backend.generate(cc.prompt(reasoning=control))
        assert info.value.reason == "REASONING_UNSUPPORTED"
        assert [v.field for v in info.value.violations] == [field]


async def check_two_calls_streamed(backend: Any, fake: ScriptedCalls, arguments: str) -> list[ToolCallDelta]:
    """Two streamed calls: the first's fragments (returned) carry its id and name once and join
    into `arguments`; the end frame holds both complete calls, finish TOOL_CALLS."""
    fake.calls.append([("get_weather", arguments), ("get_time", "{}")])
    events = await cc.collect(backend.generate_stream(ask(WEATHER, CLOCK)))
    assert isinstance(events[0], StreamStart) and events[0].enforcement == Enforcement.NATIVE
    first = [f for d in deltas(events) for f in d.tool_calls if f.index == 0]
    assert (first[0].id, first[0].name) == ("call_fake_1_0_0", "get_weather")
    assert len(first) > 2 and all(f.id == "" and f.name == "" for f in first[1:])
    assert "".join(f.arguments for f in first) == arguments
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason == FinishReason.TOOL_CALLS
    assert end.tool_calls == (
        ToolCall("call_fake_1_0_0", "get_weather", arguments),
        ToolCall("call_fake_1_0_1", "get_time", "{}"),
    )
    assert end.usage.output_tokens > 0
    return first
