"""Tool calling and thinking on Gemini, through the real `google-genai` SDK against the loopback
Gemini API: the wire form of function declarations, the function-calling config, tool turns and
thought signatures, calls returned (unary and streamed), validation with a bounded re-ask, and
thinking both ways."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

pytest.importorskip("google.genai", reason="the google-genai SDK is not installed (extra: gengate[gemini])")

import contract_checks as cc
import tool_contract
from fake_gemini import API_KEY, FakeGemini, camel
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
from gengate.providers.gemini import GeminiBackend
from gengate.tools import TOOL_CALL_ID_PREFIX
from pydantic import SecretStr
from tool_requests import CLOCK, PARIS, WEATHER, ask, chat, deltas

PING = Tool("ping")  # no parameters
# Signatures as Gemini sends them (standard base64, '+' and '/' included) and as gengate carries
# them and the SDK sends them back (URL-safe base64 of the same bytes).
SIG_CALL = base64.b64encode(b"\xfb\xff\xbecall-signature").decode()
SIG_THOUGHT = base64.b64encode(b"\xfb\xef\xffthought-signature").decode()
SIG_TEXT = base64.b64encode(b"\xff\xfe\xfdtext-signature").decode()


def safe(signature: str) -> str:
    """A signature as gengate carries it and the SDK sends it: URL-safe base64."""
    return base64.urlsafe_b64encode(base64.b64decode(signature)).decode()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeGemini]:
    yield from cc.serving(FakeGemini())


@pytest.fixture
async def make(fake: FakeGemini) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        GeminiBackend, "gemini", fake, model="gemini-test", base_url=fake.server.base_url, api_key=API_KEY
    ) as build:
        yield build


def body(fake: FakeGemini, i: int = 0) -> dict[str, Any]:
    """Request `i`'s body, keys in one spelling (see `fake_gemini.camel`)."""
    return dict(camel(fake.server.requests[i].body))


def test_capabilities_declare_native_tools_and_reasoning() -> None:
    backend = GeminiBackend("gemini", GeminiBackend.Options(model="g", api_key=SecretStr("k")))
    caps = backend.capabilities
    assert (caps.tools, caps.reasoning_control, caps.reasoning) == (Enforcement.NATIVE, True, True)


# --- the wire, out ----------------------------------------------------------------------------


async def test_declarations_and_each_tool_choice_on_the_wire(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(ask(WEATHER, PING, tool_choice=ToolChoice(name="get_weather")))
    sent = body(fake)
    assert sent["tools"] == [
        {
            "functionDeclarations": [
                {
                    "name": "get_weather",
                    "description": "The weather in a city.",
                    "parametersJsonSchema": WEATHER.parameters,
                },
                {"name": "ping"},  # no parameters: none declared
            ]
        }
    ]
    named = {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}}
    assert sent["toolConfig"] == named
    cases = [
        (ToolChoice(ToolChoiceMode.AUTO), "AUTO"),
        (ToolChoice(ToolChoiceMode.REQUIRED), "ANY"),
        (ToolChoice(ToolChoiceMode.NONE), "NONE"),
    ]
    for choice, mode in cases:
        fake.reset()
        if choice.mode is not ToolChoiceMode.NONE:
            fake.calls.append([("get_weather", PARIS)])
        await backend.generate(ask(tool_choice=choice))
        assert body(fake)["toolConfig"] == {"functionCallingConfig": {"mode": mode}}
    fake.reset()
    fake.calls.append([("get_weather", PARIS)])
    await backend.generate(ask(parallel_tool_calls=False))  # Gemini has no switch: nothing sent
    assert "toolConfig" not in body(fake) and len(body(fake)["tools"]) == 1


async def test_no_tools_no_tool_or_thinking_fields(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    result = await backend.generate(cc.prompt())
    sent = body(fake)
    assert not {"tools", "toolConfig"} & set(sent)
    assert "thinkingConfig" not in sent.get("generationConfig", {})
    assert result.enforcement == Enforcement.NONE


async def test_a_conversation_of_calls_results_and_signatures_on_the_wire(
    make: cc.Make, fake: FakeGemini
) -> None:
    backend = await make()
    calls = (ToolCall("fc_1", "get_weather", PARIS), ToolCall("call_2", "get_time", "{}"))
    signatures = (f"thought:{safe(SIG_THOUGHT)}", f"call:0:{safe(SIG_CALL)}", f"text:{safe(SIG_TEXT)}")
    picture = ImagePart(data=b"\x89PNG", mime_type="image/png")
    history = (
        ChatMessage(Role.SYSTEM, (TextPart("Be brief."),)),
        ChatMessage(Role.USER, (TextPart("Weather and time in Paris?"),)),
        ChatMessage(
            Role.ASSISTANT,
            (TextPart("Let me look."),),
            tool_calls=calls,
            reasoning=Reasoning("Two tools needed.", signatures),
        ),
        ChatMessage(Role.TOOL, (TextPart('{"sky": "clear"}'),), tool_call_id="fc_1"),
        ChatMessage(Role.TOOL, (TextPart("12:00"), picture), tool_call_id="call_2"),
        ChatMessage(Role.USER, (TextPart("Thanks, and tomorrow?"),)),
    )
    fake.answers.append("Clear at noon.")
    result = await backend.generate(ask(WEATHER, CLOCK, messages=history))
    sent = body(fake)
    assert sent["systemInstruction"]["parts"] == [{"text": "Be brief."}]
    assert sent["contents"] == [
        {"role": "user", "parts": [{"text": "Weather and time in Paris?"}]},
        {
            "role": "model",
            "parts": [
                {"text": "Two tools needed.", "thought": True, "thoughtSignature": safe(SIG_THOUGHT)},
                {"text": "Let me look.", "thoughtSignature": safe(SIG_TEXT)},
                {
                    "functionCall": {"id": "fc_1", "name": "get_weather", "args": {"city": "Paris"}},
                    "thoughtSignature": safe(SIG_CALL),
                },
                {"functionCall": {"id": "call_2", "name": "get_time", "args": {}}},
            ],
        },
        {
            "role": "user",  # both results in one turn, each named after the call it answers
            "parts": [
                {"functionResponse": {"id": "fc_1", "name": "get_weather", "response": {"sky": "clear"}}},
                {
                    "functionResponse": {
                        "id": "call_2",
                        "name": "get_time",
                        "response": {"output": "12:00"},
                        "parts": [
                            {
                                "inlineData": {
                                    "data": base64.b64encode(b"\x89PNG").decode(),
                                    "mimeType": "image/png",
                                }
                            }
                        ],
                    }
                },
            ],
        },
        {"role": "user", "parts": [{"text": "Thanks, and tomorrow?"}]},
    ]
    gen = result.generations[0]
    assert (gen.text, gen.tool_calls, gen.finish_reason) == ("Clear at noon.", (), FinishReason.STOP)


async def test_unsigned_or_foreign_reasoning_is_not_sent_back(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    history = (
        ChatMessage(Role.USER, (TextPart("hi"),)),
        ChatMessage(
            Role.ASSISTANT, (TextPart("hello"),), reasoning=Reasoning("from another model", ("EqQBsig",))
        ),
        ChatMessage(Role.USER, (TextPart("again"),)),
    )
    await backend.generate(chat(messages=history))
    assert body(fake)["contents"][1] == {"role": "model", "parts": [{"text": "hello"}]}


async def test_history_gemini_cannot_take_back_is_refused(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    history = (
        ChatMessage(Role.USER, (TextPart("hi"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(ToolCall("fc_1", "get_weather", "[1, 2]"),)),
        ChatMessage(Role.TOOL, (TextPart("sunny"),), tool_call_id="fc_1"),
        ChatMessage(Role.TOOL, (TextPart("rain"),), tool_call_id="fc_unknown"),
    )
    with pytest.raises(errors.InvalidArgument) as info:
        await backend.generate(ask(messages=history))
    assert [v.field for v in info.value.violations] == [
        "messages.messages[1].tool_calls[0].arguments_json",
        "messages.messages[3].tool_call_id",
    ]
    assert fake.server.requests == []


# --- calls, in ----------------------------------------------------------------------------------


async def test_unary_calls_returned_with_their_signature(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    fake.call_signature = SIG_CALL
    fake.calls.append([("get_weather", PARIS), ("get_time", json.dumps({"zone": "CET"}))])
    result = await backend.generate(ask(WEATHER, CLOCK))
    gen = result.generations[0]
    assert gen.tool_calls == (
        ToolCall("fc_fake_1_0_0", "get_weather", PARIS),
        ToolCall("fc_fake_1_0_1", "get_time", json.dumps({"zone": "CET"})),
    )
    assert (gen.finish_reason, gen.text) == (FinishReason.TOOL_CALLS, "")  # Gemini said STOP
    assert gen.reasoning == Reasoning("", (f"call:0:{safe(SIG_CALL)}",))
    assert result.enforcement == Enforcement.NATIVE and result.usage.output_tokens > 0


async def test_calls_without_ids_get_gengate_ids(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    fake.call_ids = False
    fake.calls.append([("ping", "")])
    [call] = (await backend.generate(ask(PING))).generations[0].tool_calls
    assert call.id.startswith(TOOL_CALL_ID_PREFIX) and (call.name, call.arguments) == ("ping", "{}")


async def test_stream_sends_each_call_whole_and_the_end_frame_agrees(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    fake.call_signature = SIG_CALL
    arguments = json.dumps({"city": "Paris", "unit": "C"})
    fake.calls.append([("get_weather", arguments), ("ping", "")])
    events = await cc.collect(backend.generate_stream(ask(WEATHER, PING)))
    assert isinstance(events[0], StreamStart) and events[0].enforcement == Enforcement.NATIVE
    fragments = [(f.index, f.id, f.name, f.arguments) for d in deltas(events) for f in d.tool_calls]
    assert fragments == [
        (0, "fc_fake_1_0_0", "get_weather", arguments),
        (1, "fc_fake_1_0_1", "ping", "{}"),
    ]
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason == FinishReason.TOOL_CALLS
    assert end.tool_calls == tuple(ToolCall(i, n, a) for _, i, n, a in fragments)
    assert end.reasoning_signatures == (f"call:0:{safe(SIG_CALL)}",)
    assert end.usage.output_tokens > 0


async def test_an_invalid_streamed_call_ends_the_stream_with_validation_failed(
    make: cc.Make, fake: FakeGemini
) -> None:
    await tool_contract.check_invalid_stream_aborts(await make(), fake)


# --- validation and the bounded re-ask ---------------------------------------------------------------


async def test_bad_arguments_are_reasked_with_the_error_as_function_responses(
    make: cc.Make, fake: FakeGemini
) -> None:
    backend = await make()
    fake.call_signature = SIG_CALL
    fake.calls.extend([[("get_weather", json.dumps({"city": 3}))], [("get_weather", PARIS)]])
    result = await backend.generate(ask())
    assert len(fake.server.requests) == 2
    assert result.generations[0].tool_calls == (ToolCall("fc_fake_2_0_0", "get_weather", PARIS),)
    first, second = body(fake, 0), body(fake, 1)
    assert second["tools"] == first["tools"] and second["contents"][:-2] == first["contents"]
    said, feedback = second["contents"][-2:]
    assert said == {
        "role": "model",
        "parts": [
            {
                "functionCall": {"id": "fc_fake_1_0_0", "name": "get_weather", "args": {"city": 3}},
                "thoughtSignature": safe(SIG_CALL),  # Gemini requires it back on the call
            }
        ],
    }
    assert feedback["role"] == "user"
    [part] = feedback["parts"]
    answer = part["functionResponse"]
    assert (answer["id"], answer["name"]) == ("fc_fake_1_0_0", "get_weather")
    assert "not valid" in answer["response"]["output"] and "city" in answer["response"]["output"]


async def test_reask_exhausted_is_validation_failed(make: cc.Make, fake: FakeGemini) -> None:
    await tool_contract.check_reask_exhausted(await make(), fake)


async def test_a_tool_not_offered_and_parallel_calls_are_refused(make: cc.Make, fake: FakeGemini) -> None:
    await tool_contract.check_not_offered_and_parallel_refused(await make(validation_retries=0), fake)


async def test_a_malformed_function_call_is_an_error_and_reasked_where_a_call_is_required(
    make: cc.Make, fake: FakeGemini
) -> None:
    backend = await make()
    fake.finish_reason = "MALFORMED_FUNCTION_CALL"
    fake.answers.append("")
    gen = (await backend.generate(ask())).generations[0]
    assert (gen.finish_reason, gen.tool_calls) == (FinishReason.ERROR, ())
    fake.reset()
    fake.finish_reason = "MALFORMED_FUNCTION_CALL"
    fake.answers.append("")
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask(tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    assert "a tool call is required" in info.value.message
    feedback = body(fake, 1)["contents"][-1]
    assert feedback["role"] == "user" and "a tool call is required" in feedback["parts"][0]["text"]


# --- thinking -----------------------------------------------------------------------------------------


async def test_thinking_controls_on_the_wire(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    cases = [
        (ReasoningControl(budget_tokens=2048), {"thinkingBudget": 2048, "includeThoughts": True}),
        (ReasoningControl(enabled=True, budget_tokens=512), {"thinkingBudget": 512, "includeThoughts": True}),
        (ReasoningControl(enabled=True), {"thinkingBudget": -1, "includeThoughts": True}),
        (ReasoningControl(enabled=False), {"thinkingBudget": 0}),
        (ReasoningControl(effort=ReasoningEffort.LOW), {"thinkingLevel": "LOW", "includeThoughts": True}),
        (ReasoningControl(effort=ReasoningEffort.HIGH), {"thinkingLevel": "HIGH", "includeThoughts": True}),
    ]
    for control, wire in cases:
        fake.reset()
        await backend.generate(cc.prompt(reasoning=control))
        assert body(fake)["generationConfig"]["thinkingConfig"] == wire


async def test_an_effort_beside_a_budget_is_refused_before_sending(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    control = ReasoningControl(effort=ReasoningEffort.LOW, budget_tokens=1024)
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(cc.prompt(reasoning=control))
    assert info.value.reason == "REASONING_UNSUPPORTED"
    assert [v.field for v in info.value.violations] == ["reasoning.effort"]
    assert fake.server.requests == []


async def test_thoughts_come_back_unary_and_streamed_with_their_signatures(
    make: cc.Make, fake: FakeGemini
) -> None:
    backend = await make()
    fake.thinking = [("The user wants a greeting.", SIG_THOUGHT)]
    fake.text_signature = SIG_TEXT
    fake.answers.extend(["Hello!", "Hello again!", "Hi."])
    thinking = ReasoningControl(enabled=True)
    result = await backend.generate(chat(reasoning=thinking))
    gen = result.generations[0]
    assert result.usage.output_tokens == 1 + 5  # the answer's token and the thoughts' five
    entries = (f"thought:{safe(SIG_THOUGHT)}", f"text:{safe(SIG_TEXT)}")
    assert gen.reasoning == Reasoning("The user wants a greeting.", entries)
    assert gen.text == "Hello!"
    events = await cc.collect(backend.generate_stream(chat(reasoning=thinking)))
    assert "".join(d.reasoning for d in deltas(events)) == "The user wants a greeting."
    assert "".join(d.text for d in deltas(events)) == "Hello again!"
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.reasoning_signatures == entries
    # Not asked for, Gemini sends no thought text: only the text part's signature comes back.
    plain = await backend.generate(chat())
    assert plain.generations[0].reasoning == Reasoning("", (f"text:{safe(SIG_TEXT)}",))
    assert plain.usage.output_tokens == 1 + 5  # thinking not shown is counted all the same


async def test_a_thinking_turn_with_calls_goes_back_as_it_came(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    fake.thinking = [("Paris, so the city is Paris.", "")]  # a thought summary, unsigned
    fake.call_signature = SIG_CALL
    fake.calls.append([("get_weather", PARIS), ("get_time", "{}")])
    gen = (await backend.generate(ask(WEATHER, CLOCK, reasoning=ReasoningControl(enabled=True)))).generations[
        0
    ]
    assert gen.reasoning == Reasoning("Paris, so the city is Paris.", (f"call:0:{safe(SIG_CALL)}",))
    fake.reset()
    history = (
        ChatMessage(Role.USER, (TextPart("Weather and time in Paris?"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=gen.tool_calls, reasoning=gen.reasoning),
        ChatMessage(Role.TOOL, (TextPart("sunny"),), tool_call_id=gen.tool_calls[0].id),
        ChatMessage(Role.TOOL, (TextPart("noon"),), tool_call_id=gen.tool_calls[1].id),
    )
    await backend.generate(ask(WEATHER, CLOCK, messages=history))
    model, results = body(fake)["contents"][1:]
    assert [p.get("thoughtSignature") for p in model["parts"]] == [safe(SIG_CALL), None]
    assert [p["functionCall"]["name"] for p in model["parts"]] == ["get_weather", "get_time"]
    assert [p["functionResponse"]["response"] for p in results["parts"]] == [
        {"output": "sunny"},
        {"output": "noon"},
    ]
