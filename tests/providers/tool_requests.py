"""The tools, requests and checks the providers' tool-calling tests share (OpenAI family,
Anthropic, Cohere, Gemini). A check takes a started backend and its fake, whose `calls` holds
scripted calls (name, arguments) one list per answer and whose `server.requests` records what came."""

from __future__ import annotations

import json
from typing import Any, Protocol

import pytest
from gengate import errors
from gengate.domain import (
    ChatMessage,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    Role,
    StreamEvent,
    TextPart,
    Tool,
)

WEATHER = Tool(
    "get_weather",
    "The weather in a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city"],
    },
)
CLOCK = Tool("get_time", parameters={"type": "object", "properties": {"zone": {"type": "string"}}})
PARIS = json.dumps({"city": "Paris"})


def chat(**kw: Any) -> GenerationRequest:
    """A chat asking about the weather (no tools unless given)."""
    messages = kw.pop("messages", (ChatMessage(Role.USER, (TextPart("Weather in Paris?"),)),))
    return GenerationRequest(model="m", messages=messages, request_id="req-tools", **kw)


def ask(*tools: Tool, **kw: Any) -> GenerationRequest:
    """The chat offering `tools` (WEATHER by default)."""
    return chat(tools=tools or (WEATHER,), **kw)


def deltas(events: list[StreamEvent]) -> list[GenerationDelta]:
    return [e for e in events if isinstance(e, GenerationDelta)]


class ScriptedFake(Protocol):
    """A provider fake taking scripted calls (one list of (name, arguments) per request)."""

    calls: list[list[tuple[str, str]]]
    server: Any


async def check_invalid_stream_aborts(backend: Any, fake: ScriptedFake) -> None:
    """A streamed call with invalid arguments ends the stream with Aborted VALIDATION_FAILED,
    after its fragments and before any end frame, and is never re-asked."""
    fake.calls.append([("get_weather", json.dumps({"city": "Paris", "unit": "K"}))])
    events: list[StreamEvent] = []
    with pytest.raises(errors.Aborted) as info:
        async for event in backend.generate_stream(ask()):
            events.append(event)
    assert info.value.reason == "VALIDATION_FAILED"
    assert deltas(events) and not any(isinstance(e, GenerationEnd) for e in events)
    assert len(fake.server.requests) == 1


async def check_reask_exhausted(backend: Any, fake: ScriptedFake) -> None:
    """Arguments that stay invalid are Aborted VALIDATION_FAILED after the first try and
    validation_retries (2) re-asks, the message naming the tool."""
    fake.calls.extend([[("get_weather", json.dumps({"town": "Paris"}))]] * 5)
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask())
    assert info.value.reason == "VALIDATION_FAILED"
    assert "3 tries" in info.value.message and "get_weather" in info.value.message
    assert len(fake.server.requests) == 3

async def check_unoffered_and_parallel_refused(backend: Any, fake: ScriptedFake) -> None:
    """With no re-ask allowed (validation_retries 0), a tool not offered and two calls where
    parallel_tool_calls is false are each Aborted after one request."""
    fake.calls.append([("delete_everything", "{}")])
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask())
    assert "'delete_everything', which is not an offered tool" in info.value.message
    fake.calls.append([("get_weather", PARIS), ("get_weather", PARIS)])
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask(parallel_tool_calls=False))
    assert "parallel_tool_calls is false" in info.value.message
    assert len(fake.server.requests) == 2  # no re-ask allowed
