"""Tool calling and reasoning on the OpenAI family, through the real `openai` SDK against the
loopback chat API: the wire mapping of tools, tool choice and tool turns, calls returned
(unary and streamed), validation with a bounded re-ask, and reasoning both ways."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[openai])")

import contract_checks as cc
import tool_contract
from fake_openai import API_KEY, ARGUMENT_FRAGMENT, FakeOpenAI
from gengate import errors
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    ReasoningControl,
    ReasoningEffort,
    Role,
    StreamEvent,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from gengate.providers import openai as oai
from gengate.providers.base import Completion, ProviderBackend
from gengate.providers.ollama import OllamaBackend
from gengate.tools import TOOL_CALL_ID_PREFIX
from pydantic import SecretStr
from tool_requests import CLOCK, PARIS, WEATHER, ask, deltas

STRICT_WEATHER = Tool(WEATHER.name, WEATHER.description, WEATHER.parameters, strict=True)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def made(fake: FakeOpenAI) -> AsyncIterator[list[ProviderBackend]]:
    fake.reset()
    backends: list[ProviderBackend] = []
    yield backends
    for backend in backends:
        await backend.aclose()


@pytest.fixture
def build(fake: FakeOpenAI, made: list[ProviderBackend]) -> Any:
    async def start(cls: type[oai.OpenAIChatBackend] = oai.OpenAIBackend, **overrides: Any) -> Any:
        opts: dict[str, Any] = {
            "model": "gpt-test",
            "base_url": fake.server.base_url + "/v1",
            "api_key": SecretStr(API_KEY),
            "timeout": 5.0,
            "max_retries": 0,
        } | overrides
        if cls is oai.VLLMServerBackend:
            opts.setdefault("canary", False)
        backend = cls("gpt", cls.Options(**opts))
        await backend.start()
        made.append(backend)
        return backend

    return start


async def until_error(stream: AsyncIterator[StreamEvent]) -> tuple[list[StreamEvent], errors.GengateError]:
    """The events a stream sent before it failed, and its error (the test fails if it does not)."""
    events: list[StreamEvent] = []
    with pytest.raises(errors.GengateError) as info:
        async for event in stream:
            events.append(event)
    return events, info.value


# --- capabilities ---------------------------------------------------------------------------------


FAMILY = [
    oai.OpenAIBackend,
    oai.AzureOpenAIBackend,
    oai.TogetherBackend,
    oai.GroqBackend,
    oai.AnyscaleBackend,
    oai.VLLMServerBackend,
    oai.SGLangBackend,
    oai.LlamaCppServerBackend,
    oai.OpenAICompatibleBackend,
    OllamaBackend,
]


@pytest.mark.parametrize("cls", FAMILY, ids=lambda c: c.kind)
def test_every_member_declares_native_tools(cls: type[oai.OpenAIChatBackend]) -> None:
    options = cls.Options(model="m", base_url="http://127.0.0.1:9/v1", api_key=SecretStr(API_KEY))
    caps = cls("m", options).capabilities
    assert caps.tools == Enforcement.NATIVE
    openai_itself = cls in (oai.OpenAIBackend, oai.AzureOpenAIBackend)
    # OpenAI takes reasoning_effort but never returns the thinking; the servers the other way round.
    assert (caps.reasoning_control, caps.reasoning) == (openai_itself, not openai_itself)


class _NoTools(ProviderBackend):
    """A provider that maps no tool calling (every call upstream fails the test)."""

    kind = "no_tools"

    async def _complete(self, call: Any) -> Completion:
        raise AssertionError("refused tools must not reach the upstream")

    def _stream(self, call: Any) -> AsyncIterator[Any]:
        raise AssertionError("refused tools must not reach the upstream")


async def test_a_provider_without_tools_refuses_them_before_any_request() -> None:
    backend = _NoTools("plain", _NoTools.Options(model="c", api_key=SecretStr("k")))
    assert backend.capabilities.tools is None
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(ask())  # never started: refused before any client is needed
    assert info.value.reason == "TOOLS_UNSUPPORTED"
    assert [v.field for v in info.value.violations] == ["tools"]
    history = (
        ChatMessage(Role.USER, (TextPart("hi"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(ToolCall("call_1", "get_weather", PARIS),)),
        ChatMessage(Role.TOOL, (TextPart("sunny"),), tool_call_id="call_1"),
    )
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(GenerationRequest(model="m", messages=history))
    assert [v.field for v in info.value.violations] == ["messages.messages[1].tool_calls"]


# --- the wire, out ----------------------------------------------------------------------------------


async def test_tools_choice_and_parallel_on_the_wire(build: Any, fake: FakeOpenAI) -> None:
    await tool_contract.check_tools_on_the_wire(await build(), fake, parallel=True)


async def test_no_tools_no_tool_fields(build: Any, fake: FakeOpenAI) -> None:
    backend = await build()
    result = await backend.generate(cc.prompt())
    body = fake.server.requests[0].body
    assert not {"tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"} & set(body)
    assert result.enforcement == Enforcement.NONE


async def test_strict_tool_schema_and_the_nulls_it_forces(build: Any, fake: FakeOpenAI) -> None:
    backend = await build()
    fake.calls.append([("get_weather", json.dumps({"city": "Paris", "unit": None}))])
    result = await backend.generate(ask(STRICT_WEATHER))
    function = fake.server.requests[0].body["tools"][0]["function"]
    assert function["strict"] is True
    assert function["parameters"]["required"] == ["city", "unit"]
    assert function["parameters"]["additionalProperties"] is False
    assert function["parameters"]["properties"]["unit"]["anyOf"][1] == {"type": "null"}
    # unit was optional: the null strict mode forced in is not the caller's to see
    assert json.loads(result.generations[0].tool_calls[0].arguments) == {"city": "Paris"}


async def test_strict_is_not_sent_where_the_schema_cannot_be_strict_or_the_server_has_none(
    build: Any, fake: FakeOpenAI
) -> None:
    # a free-form map: strict mode would drop the keys beyond `properties`
    tags = {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}}
    loose = Tool("lookup", parameters={"type": "object", "properties": {"tags": tags}}, strict=True)
    backend = await build()
    fake.calls.append([("lookup", json.dumps({"tags": {"a": "b"}}))])
    await backend.generate(ask(loose))
    function = fake.server.requests[0].body["tools"][0]["function"]
    assert (
        "strict" not in function and function["parameters"] == loose.parameters
    )  # format is not strict-able
    fake.reset()
    vllm = await build(oai.VLLMServerBackend)
    fake.calls.append([("get_weather", PARIS)])
    await vllm.generate(ask(STRICT_WEATHER))
    function = fake.server.requests[0].body["tools"][0]["function"]
    assert "strict" not in function and function["parameters"] == WEATHER.parameters


async def test_a_prompt_with_tools_goes_to_chat_on_a_raw_prompt_server(build: Any, fake: FakeOpenAI) -> None:
    backend = await build(oai.VLLMServerBackend)
    fake.calls.append([("get_weather", PARIS)])
    result = await backend.generate(
        GenerationRequest(model="m", prompt="Weather in Paris?", tools=(WEATHER,))
    )
    assert fake.server.requests[0].path == "/v1/chat/completions"
    assert result.generations[0].tool_calls[0].name == "get_weather"


async def test_round_trip_of_a_call_and_its_result(build: Any, fake: FakeOpenAI) -> None:
    backend = await build()
    call = ToolCall("call_abc", "get_weather", PARIS)
    wire_call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": PARIS},
    }
    history = (
        ChatMessage(Role.USER, (TextPart("Weather in Paris?"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(call,)),
        ChatMessage(Role.TOOL, (TextPart('{"sky": "clear"}'),), tool_call_id="call_abc"),
    )
    fake.answers.append("Clear skies in Paris.")
    result = await backend.generate(ask(messages=history))
    assert fake.server.requests[0].body["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [wire_call],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"sky": "clear"}'},
    ]
    gen = result.generations[0]
    assert (gen.text, gen.tool_calls, gen.finish_reason) == ("Clear skies in Paris.", (), FinishReason.STOP)


# --- calls, in ----------------------------------------------------------------------------------


async def test_unary_call_returned(build: Any, fake: FakeOpenAI) -> None:
    backend = await build()
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


async def test_calls_without_ids_get_ours_and_a_forced_tools_stop_reads_tool_calls(
    build: Any, fake: FakeOpenAI
) -> None:
    backend = await build()
    fake.call_ids, fake.tool_finish_reason = False, "stop"  # OpenAI's finish reason for a named tool
    fake.calls.append([("get_weather", PARIS), ("get_weather", json.dumps({"city": "Oslo"}))])
    gen = (await backend.generate(ask(tool_choice=ToolChoice(name="get_weather")))).generations[0]
    ids = [c.id for c in gen.tool_calls]
    assert all(i.startswith(TOOL_CALL_ID_PREFIX) and len(i) > len(TOOL_CALL_ID_PREFIX) for i in ids)
    assert len(set(ids)) == 2
    assert gen.finish_reason == FinishReason.TOOL_CALLS


async def test_stream_deltas_then_the_complete_calls_in_the_end_frame(build: Any, fake: FakeOpenAI) -> None:
    arguments = json.dumps({"city": "Paris", "unit": "C"})
    first = await tool_contract.check_two_calls_streamed(await build(), fake, arguments)
    assert first[0].arguments == ""
    assert len(first) == 1 + -(-len(arguments) // ARGUMENT_FRAGMENT)  # the fragments as sent


async def test_a_streamed_call_without_id_gets_one_that_the_end_frame_keeps(
    build: Any, fake: FakeOpenAI
) -> None:
    backend = await build(oai.OpenAICompatibleBackend)
    fake.call_ids = False
    fake.calls.append([("get_weather", PARIS)])
    events = await cc.collect(backend.generate_stream(ask()))
    first = deltas(events)[0].tool_calls[0]
    assert first.id.startswith(TOOL_CALL_ID_PREFIX)
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.tool_calls == (ToolCall(first.id, "get_weather", PARIS),)


# --- validation and the bounded re-ask ---------------------------------------------------------------


async def test_bad_arguments_are_reasked_with_the_error(build: Any, fake: FakeOpenAI) -> None:
    backend = await build()
    bad = json.dumps({"city": 3})
    fake.calls.extend([[("get_weather", bad)], [("get_weather", PARIS)]])
    result = await backend.generate(ask())
    assert len(fake.server.requests) == 2
    assert result.generations[0].tool_calls[0].arguments == PARIS
    first, second = (r.body for r in fake.server.requests)
    assert second["tools"] == first["tools"]  # asked again with the same tools
    assert second["messages"][:-2] == first["messages"]
    assistant, answer = second["messages"][-2:]
    assert assistant == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_fake_1_0_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": bad},
            }
        ],
    }
    assert answer["role"] == "tool" and answer["tool_call_id"] == "call_fake_1_0_0"
    assert "not valid" in answer["content"] and "city" in answer["content"]


async def test_reask_exhausted_is_validation_failed(build: Any, fake: FakeOpenAI) -> None:
    backend = await build()
    fake.calls.extend([[("get_weather", "{not json")]] * 5)
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask())
    assert info.value.reason == "VALIDATION_FAILED"
    assert "3 tries" in info.value.message and "get_weather" in info.value.message
    assert len(fake.server.requests) == 3  # the first try and validation_retries (2) re-asks


async def test_a_tool_not_offered_is_refused(build: Any, fake: FakeOpenAI) -> None:
    backend = await build(validation_retries=0)
    fake.calls.append([("delete_everything", "{}")])
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask())
    assert info.value.reason == "VALIDATION_FAILED"
    assert "'delete_everything', which is not an offered tool" in info.value.message
    assert len(fake.server.requests) == 1  # no re-ask allowed


async def test_a_call_under_tool_choice_none_is_refused(build: Any, fake: FakeOpenAI) -> None:
    backend = await build(validation_retries=0)
    fake.calls.append([("get_weather", PARIS)])
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(ask(tool_choice=ToolChoice(ToolChoiceMode.NONE)))
    assert "tool_choice is none" in info.value.message


async def test_parallel_calls_refused_when_parallel_is_false(build: Any, fake: FakeOpenAI) -> None:
    backend = await build(validation_retries=1)
    two = [("get_weather", PARIS), ("get_weather", PARIS)]
    fake.calls.extend([two, [("get_weather", PARIS)]])
    result = await backend.generate(ask(parallel_tool_calls=False))
    assert len(result.generations[0].tool_calls) == 1 and len(fake.server.requests) == 2
    answers = fake.server.requests[1].body["messages"][-2:]  # each of the two calls answered
    assert [m["role"] for m in answers] == ["tool", "tool"]
    assert "parallel_tool_calls is false" in answers[0]["content"]


async def test_text_where_a_call_is_required_is_reasked_as_a_user_turn(build: Any, fake: FakeOpenAI) -> None:
    backend = await build()
    fake.calls.extend([[], [("get_weather", PARIS)]])  # a text first, then the call
    fake.answers.append("It is sunny, I think.")
    result = await backend.generate(ask(tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    assert result.generations[0].tool_calls[0].arguments == PARIS
    said, feedback = fake.server.requests[1].body["messages"][-2:]
    assert said == {"role": "assistant", "content": "It is sunny, I think."}
    assert feedback["role"] == "user" and "a tool call is required" in feedback["content"]


async def test_only_the_invalid_choice_is_reasked(build: Any, fake: FakeOpenAI) -> None:
    backend = await build()
    fake.calls.extend(
        [[("get_weather", PARIS)], [("get_weather", "{}")], [("get_weather", json.dumps({"city": "Rome"}))]]
    )
    result = await backend.generate(ask(n=2))
    assert [json.loads(g.tool_calls[0].arguments)["city"] for g in result.generations] == ["Paris", "Rome"]
    assert [g.index for g in result.generations] == [0, 1]
    first, second = (r.body for r in fake.server.requests)
    assert first["n"] == 2 and "n" not in second  # one choice re-asked
    assert "required" in second["messages"][-1]["content"]  # city is missing


async def test_an_invalid_streamed_call_ends_the_stream_with_validation_failed(
    build: Any, fake: FakeOpenAI
) -> None:
    backend = await build()
    fake.calls.append([("get_weather", json.dumps({"city": "Paris", "unit": "K"}))])
    events, error = await until_error(backend.generate_stream(ask()))
    assert isinstance(error, errors.Aborted) and error.reason == "VALIDATION_FAILED"
    assert "unit" in error.message or "'K'" in error.message
    assert deltas(events) and not any(isinstance(e, GenerationEnd) for e in events)  # no end frame
    assert len(fake.server.requests) == 1  # a stream is never re-asked


async def test_a_batch_answer_is_validated_once(build: Any, fake: FakeOpenAI) -> None:
    from gengate.domain import Generation

    backend = await build()
    call = backend._prepare(ask())
    bad = Generation(0, "", FinishReason.TOOL_CALLS, tool_calls=(ToolCall("c1", "get_weather", "{}"),))
    with pytest.raises(errors.Aborted) as info:
        backend.offline_result(call, Completion([bad]))
    assert info.value.reason == "VALIDATION_FAILED"
    good = Generation(0, "", FinishReason.TOOL_CALLS, tool_calls=(ToolCall("", "get_weather", PARIS),))
    result = backend.offline_result(call, Completion([good]))
    assert result.generations[0].tool_calls[0].id.startswith(TOOL_CALL_ID_PREFIX)


# --- reasoning ------------------------------------------------------------------------------------


async def test_reasoning_effort_on_the_wire_and_the_knobs_openai_lacks(build: Any, fake: FakeOpenAI) -> None:
    backend = await build(request_options=["reasoning_effort"], extra_body={"reasoning_effort": "low"})
    await backend.generate(cc.prompt(reasoning=ReasoningControl(effort=ReasoningEffort.HIGH)))
    assert fake.server.requests[0].body["reasoning_effort"] == "high"  # over the config's default
    refused = {
        "reasoning.budget_tokens": ReasoningControl(budget_tokens=1024),
        "reasoning.enabled": ReasoningControl(enabled=False),
    }
    await tool_contract.check_reasoning_refused(backend, refused)
    both = cc.prompt(
        reasoning=ReasoningControl(effort=ReasoningEffort.LOW), backend_options={"reasoning_effort": "high"}
    )
    with pytest.raises(errors.InvalidArgument) as bad:
        await backend.generate(both)
    assert bad.value.violations[0].field == "backend_options[reasoning_effort]"
    assert len(fake.server.requests) == 1  # the refusals sent nothing


async def test_a_compatible_server_takes_no_reasoning_control(build: Any, fake: FakeOpenAI) -> None:
    backend = await build(oai.VLLMServerBackend)
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(cc.prompt(reasoning=ReasoningControl(effort=ReasoningEffort.LOW)))
    assert info.value.reason == "REASONING_UNSUPPORTED" and info.value.violations[0].field == "reasoning"
    assert fake.server.requests == []


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_reasoning_content_comes_back_unary_and_streamed(
    build: Any, fake: FakeOpenAI, field: str
) -> None:
    fake.reasoning_field = field
    await tool_contract.check_reasoning_out(await build(oai.VLLMServerBackend), fake)


async def test_reasoning_is_not_sent_back_on_the_wire(build: Any, fake: FakeOpenAI) -> None:
    from gengate.domain import Reasoning

    backend = await build(oai.VLLMServerBackend)
    history = (
        ChatMessage(Role.USER, (TextPart("hi"),)),
        ChatMessage(Role.ASSISTANT, (TextPart("hello"),), reasoning=Reasoning("greet back")),
        ChatMessage(Role.USER, (TextPart("again"),)),
    )
    await backend.generate(GenerationRequest(model="m", messages=history))
    assert fake.server.requests[0].body["messages"][1] == {"role": "assistant", "content": "hello"}
