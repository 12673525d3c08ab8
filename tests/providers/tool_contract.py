"""Tool-calling checks every native provider passes the same way (the validation the base does
on whatever the provider returned), driven through a fake that scripts calls as one list of
(name, arguments JSON text) pairs per answer (`fake.calls`) and records every request."""

from __future__ import annotations

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
    Role,
    StreamEvent,
    TextPart,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from tool_requests import CLOCK, PARIS, WEATHER, ask, deltas

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
