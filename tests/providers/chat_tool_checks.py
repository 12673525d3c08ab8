"""Tool-calling checks shared by the providers that speak the chat-completions tool wire (TGI,
LiteLLM; the OpenAI family shares its wire constants): each drives a started backend against a
fake with the common script surface (`calls`: one list of (name, arguments) per answer,
`answers`, `reasoning`, `server.requests`) and asserts what goes out and what comes back."""

from __future__ import annotations

import json
from typing import Any, Protocol

import contract_checks as cc
import pytest
from gengate import errors
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationEnd,
    ReasoningControl,
    Role,
    StreamStart,
    TextPart,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
)
from tool_requests import CLOCK, PARIS, WEATHER, ask, chat, deltas

# WEATHER and CLOCK as chat-completions function tools.
WIRE_TOOLS = [
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
SKY = '{"sky": "clear"}'


class ToolFake(Protocol):
    """What the checks script and read on a fake (FakeOpenAI, FakeTGI)."""

    answers: list[str]
    calls: list[list[tuple[str, str]]]
    reasoning: str | None
    server: Any

    def reset(self) -> None: ...


def wire_call(call_id: str, arguments: str = PARIS, name: str = "get_weather") -> dict[str, Any]:
    """One call as an assistant turn's `tool_calls` entry."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


async def check_tools_on_the_wire(backend: Any, fake: ToolFake, *, parallel: bool) -> None:
    """Tools, a named choice and each mode as sent; the parallel switch sent exactly when the
    provider has one (`parallel`); none of it on a request without tools."""
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(
        ask(WEATHER, CLOCK, tool_choice=ToolChoice(name="get_weather"), parallel_tool_calls=False)
    )
    body = fake.server.requests[0].body
    assert body["tools"] == WIRE_TOOLS
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


async def check_reask(backend: Any, fake: ToolFake, call_id: str) -> None:
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


async def check_reask_bounded(make: cc.Make, fake: ToolFake) -> None:
    """Calls that stay bad end VALIDATION_FAILED after the re-asks allowed; a tool not offered
    too, at once with no re-ask allowed."""
    backend = await make()
    fake.calls.extend([[("get_weather", "{not json")]] * 5)
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask())
    assert info.value.reason == "VALIDATION_FAILED"
    assert len(fake.server.requests) == 3  # the first try and validation_retries (2) re-asks
    fake.reset()
    strict = await make(validation_retries=0)
    fake.calls.append([("delete_everything", "{}")])
    with pytest.raises(errors.Aborted) as info:
        await strict.generate(ask())
    assert "'delete_everything', which is not an offered tool" in info.value.message
    assert len(fake.server.requests) == 1


async def check_round_trip(backend: Any, fake: ToolFake, call_id: str) -> None:
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


async def check_reasoning_out(backend: Any, fake: ToolFake) -> None:
    """The model's reasoning comes back beside the answer, unary and streamed."""
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


async def check_two_calls_returned(backend: Any, fake: ToolFake) -> None:
    """Two calls in one answer come back in order with the provider's ids (the OpenAI fake's
    `call_fake_<request>_<choice>_<call>`), finish TOOL_CALLS, no text."""
    fake.calls.append([("get_weather", PARIS), ("get_time", json.dumps({"zone": "CET"}))])
    result = await backend.generate(ask(WEATHER, CLOCK))
    gen = result.generations[0]
    assert [(c.name, json.loads(c.arguments)) for c in gen.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert [c.id for c in gen.tool_calls] == ["call_fake_1_0_0", "call_fake_1_0_1"]  # the provider's ids
    assert (gen.finish_reason, gen.text) == (FinishReason.TOOL_CALLS, "")
    assert result.enforcement == Enforcement.NATIVE


async def check_two_calls_streamed(backend: Any, fake: ToolFake, arguments: str) -> list[ToolCallDelta]:
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
