"""Tool calling and reasoning on LiteLLM: the real `litellm` library routed ("openai/<x>" +
base_url) to the loopback OpenAI chat API: whether a model takes tools (LiteLLM's word or the
config's), the wire form of tools, tool choice, the parallel switch and tool turns, calls
returned (unary and streamed), validation with a bounded re-ask, and reasoning both ways."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("litellm", reason="litellm is not installed (extra: gengate[litellm])")

import contract_checks as cc
import tool_contract as ct
from fake_anthropic import API_KEY as ANTHROPIC_KEY
from fake_anthropic import FakeAnthropic
from fake_openai import API_KEY, FakeOpenAI
from gengate import errors
from gengate.domain import (
    Enforcement,
    ReasoningControl,
    ReasoningEffort,
    StoppingCriteria,
    Tool,
    ToolChoice,
    ToolChoiceMode,
)
from tool_requests import PARIS, WEATHER, ask, chat


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    yield from cc.serving(FakeOpenAI())


@pytest.fixture
async def make(fake: FakeOpenAI) -> AsyncIterator[cc.Make]:
    from gengate.providers.litellm import LiteLLMBackend

    async with cc.backends(
        LiteLLMBackend,
        "lite",
        fake,
        model="openai/fake-gpt",
        base_url=fake.server.base_url + "/v1",
        api_key=API_KEY,
        function_calling=True,
    ) as build:
        yield build


async def test_tools_follow_litellm_or_the_config(make: cc.Make, fake: FakeOpenAI) -> None:
    unknown = await make(function_calling=None)  # LiteLLM does not know "openai/fake-gpt"
    assert unknown.capabilities.tools is None
    with pytest.raises(errors.Unimplemented) as info:
        await unknown.generate(ask())
    assert info.value.reason == "TOOLS_UNSUPPORTED" and [v.field for v in info.value.violations] == ["tools"]
    assert fake.server.requests == []
    known = await make(model="openai/gpt-4o-mini", function_calling=None)
    assert known.capabilities.tools == Enforcement.NATIVE
    assert (await make()).capabilities.tools == Enforcement.NATIVE  # the config says so
    assert (await make(model="openai/gpt-4o-mini", function_calling=False)).capabilities.tools is None


async def test_tools_choice_and_parallel_on_the_wire(make: cc.Make, fake: FakeOpenAI) -> None:
    await ct.check_tools_on_the_wire(await make(), fake, parallel=True)
    fake.reset()
    await (await make()).generate(cc.prompt())
    assert "reasoning_effort" not in fake.server.requests[0].body


async def test_the_parallel_switch_is_left_to_validation_where_litellm_lists_none(
    make: cc.Make, fake: FakeOpenAI
) -> None:
    backend = await make(model="openai/o3-mini")  # LiteLLM lists no parallel_tool_calls for it
    two = [("get_weather", PARIS), ("get_weather", json.dumps({"city": "Oslo"}))]
    fake.calls.extend([two, [("get_weather", PARIS)]])
    result = await backend.generate(ask(parallel_tool_calls=False))
    assert "parallel_tool_calls" not in fake.server.requests[0].body
    assert len(result.generations[0].tool_calls) == 1 and len(fake.server.requests) == 2
    answers = fake.server.requests[1].body["messages"][-2:]
    assert [m["role"] for m in answers] == ["tool", "tool"]
    assert "parallel_tool_calls is false" in answers[0]["content"]


async def test_a_choice_litellm_lists_no_tool_choice_for_is_refused(make: cc.Make, fake: FakeOpenAI) -> None:
    backend = await make(model="ollama/llama3.1", function_calling=None)  # calls, but no tool_choice
    assert backend.capabilities.tools == Enforcement.NATIVE
    for choice in (ToolChoice(ToolChoiceMode.REQUIRED), ToolChoice(name="get_weather")):
        with pytest.raises(errors.Unimplemented) as info:
            await backend.generate(ask(tool_choice=choice))
        assert info.value.reason == "TOOLS_UNSUPPORTED"
        assert [v.field for v in info.value.violations] == ["tool_choice"]
    assert fake.server.requests == []


async def test_strict_tools_in_openais_form_where_sent_and_the_nulls_they_force_dropped(
    make: cc.Make, fake: FakeOpenAI
) -> None:
    strict = Tool(WEATHER.name, WEATHER.description, WEATHER.parameters, strict=True)
    backend = await make(strict_tools=True)
    fake.calls.append([("get_weather", json.dumps({"city": "Paris", "unit": None}))])
    result = await backend.generate(ask(strict))
    function = fake.server.requests[0].body["tools"][0]["function"]
    assert function["strict"] is True and function["parameters"]["required"] == ["city", "unit"]
    assert function["parameters"]["additionalProperties"] is False
    assert json.loads(result.generations[0].tool_calls[0].arguments) == {"city": "Paris"}
    fake.reset()
    compatible = await make()  # "openai/<x>" at a base_url: some compatible server, not strict
    fake.calls.append([("get_weather", PARIS)])
    await compatible.generate(ask(strict))
    function = fake.server.requests[0].body["tools"][0]["function"]
    assert "strict" not in function and function["parameters"] == WEATHER.parameters


async def test_unary_calls_returned(make: cc.Make, fake: FakeOpenAI) -> None:
    await ct.check_unary_calls(await make(), fake, ("call_fake_1_0_0", "call_fake_1_0_1"))


async def test_stream_deltas_assemble_into_the_end_frames_calls(make: cc.Make, fake: FakeOpenAI) -> None:
    await ct.check_two_calls_streamed(await make(), fake, json.dumps({"city": "Paris", "unit": "C"}))


async def test_bad_arguments_are_reasked_with_the_calls_and_their_errors(
    make: cc.Make, fake: FakeOpenAI
) -> None:
    await ct.check_reask(await make(), fake, "call_fake_1_0_0")


async def test_bad_calls_are_reasked_a_bounded_number_of_times(make: cc.Make, fake: FakeOpenAI) -> None:
    await ct.check_reask_exhausted(await make(), fake)
    fake.reset()
    await ct.check_not_offered_and_parallel_refused(await make(validation_retries=0), fake)


async def test_an_invalid_streamed_call_ends_the_stream_with_validation_failed(
    make: cc.Make, fake: FakeOpenAI
) -> None:
    await ct.check_invalid_stream_aborts(await make(), fake)


async def test_round_trip_of_a_call_and_its_result(make: cc.Make, fake: FakeOpenAI) -> None:
    await ct.check_round_trip(await make(), fake, "call_abc")


async def test_reasoning_effort_out_and_the_knobs_litellm_lacks(make: cc.Make, fake: FakeOpenAI) -> None:
    backend = await make()
    assert backend.capabilities.reasoning_control and backend.capabilities.reasoning
    await backend.generate(cc.prompt(reasoning=ReasoningControl(effort=ReasoningEffort.HIGH)))
    assert fake.server.requests[0].body["reasoning_effort"] == "high"
    refused = {
        "reasoning.budget_tokens": ReasoningControl(budget_tokens=1024),  # no thinking listed for it
        "reasoning.enabled": ReasoningControl(enabled=True),
    }
    await ct.check_reasoning_refused(backend, refused)
    assert len(fake.server.requests) == 1


async def test_reasoning_content_comes_back_unary_and_streamed(make: cc.Make, fake: FakeOpenAI) -> None:
    await ct.check_reasoning_out(await make(), fake)


# --- Anthropic's thinking through LiteLLM ------------------------------------------------------


@pytest.fixture(scope="module")
def claude() -> Iterator[FakeAnthropic]:
    yield from cc.serving(FakeAnthropic())


@pytest.fixture
async def make_claude(claude: FakeAnthropic) -> AsyncIterator[cc.Make]:
    from gengate.providers.litellm import LiteLLMBackend

    async with cc.backends(
        LiteLLMBackend,
        "lite-claude",
        claude,
        model="anthropic/claude-sonnet-4-20250514",  # LiteLLM lists tools, thinking, reasoning_effort
        base_url=claude.server.base_url,
        api_key=ANTHROPIC_KEY,
    ) as build:
        yield build


THOUGHTS = [("Paris is a city.", "sig-one"), (" Ask for the weather.", "sig-two")]
THINKING = ReasoningControl(budget_tokens=1024)


async def test_a_thinking_budget_goes_as_litellms_thinking(
    make_claude: cc.Make, claude: FakeAnthropic
) -> None:
    backend = await make_claude()
    assert backend.capabilities.tools == Enforcement.NATIVE and backend.capabilities.reasoning_control
    claude.answers.append("Sunny.")
    await backend.generate(chat(reasoning=THINKING, stopping=StoppingCriteria(max_tokens=4096)))
    assert claude.server.requests[0].body["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(chat(reasoning=ReasoningControl(enabled=True)))
    assert [v.field for v in info.value.violations] == ["reasoning.enabled"]
    assert len(claude.server.requests) == 1


async def test_signed_thinking_comes_back_and_goes_back_with_the_reasked_call(
    make_claude: cc.Make, claude: FakeAnthropic
) -> None:
    backend = await make_claude()
    claude.thinking = list(THOUGHTS)
    claude.calls.extend([[("get_weather", json.dumps({"city": 3}))], [("get_weather", PARIS)]])
    result = await backend.generate(ask(reasoning=THINKING, stopping=StoppingCriteria(max_tokens=4096)))
    gen = result.generations[0]
    assert json.loads(gen.tool_calls[0].arguments) == {"city": "Paris"}
    assert gen.reasoning is not None and gen.reasoning.text == "Paris is a city. Ask for the weather."
    assert len(gen.reasoning.signatures) == 2 and gen.reasoning.signatures[0].endswith("sig-one")
    reask = claude.server.requests[1].body["messages"]
    assistant = reask[-2]
    assert assistant["role"] == "assistant"
    # Anthropic requires the turn's thinking blocks, as they came, before the call they led to
    assert [b["type"] for b in assistant["content"]] == ["thinking", "thinking", "tool_use"]
    assert [(b["thinking"], b["signature"]) for b in assistant["content"][:2]] == THOUGHTS
    assert reask[-1]["content"][0]["type"] == "tool_result"
    assert "not valid" in json.dumps(reask[-1]["content"])


async def test_streamed_thinking_ends_with_the_signatures_and_goes_back_as_it_came(
    make_claude: cc.Make, claude: FakeAnthropic
) -> None:
    claude.thinking = list(THOUGHTS)
    assistant = await ct.check_thinking_round_trip(
        await make_claude(), claude, "".join(t for t, _ in THOUGHTS)
    )
    assert [b["type"] for b in assistant["content"]] == ["thinking", "thinking", "tool_use"]
    assert [(b["thinking"], b["signature"]) for b in assistant["content"][:2]] == THOUGHTS
