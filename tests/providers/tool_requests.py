"""The tools and requests the providers' tool-calling tests share (the checks they share are in
tool_contract)."""

from __future__ import annotations

import json
from typing import Any

from gengate.domain import (
    ChatMessage,
    GenerationDelta,
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
