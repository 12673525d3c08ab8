"""Anthropic backend driven through the real `anthropic` SDK against a loopback Messages API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("anthropic", reason="the anthropic SDK is not installed (extra: gengate[anthropic])")

import contract_checks as cc
from fake_anthropic import API_KEY, FakeAnthropic
from gengate import errors
from gengate.domain import (
    ChoiceConstraint,
    Enforcement,
    FinishReason,
    GrammarConstraint,
    GrammarSyntax,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuredOutput,
)
from gengate.providers.anthropic import AnthropicBackend
from pydantic import SecretStr


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAnthropic]:
    yield from cc.serving(FakeAnthropic())


@pytest.fixture
async def make(fake: FakeAnthropic) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        AnthropicBackend,
        "claude",
        fake,
        model="claude-test",
        base_url=fake.server.base_url,
        api_key=SecretStr(API_KEY),
    ) as build:
        yield build


async def test_text(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_text(make, fake)
    body = fake.server.requests[0].body
    assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}]
    assert body["max_tokens"] == 1024


async def test_stream_usage_in_final_frame(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_stream(make, fake)
    assert fake.server.requests[0].body["stream"] is True


async def test_streams_keep_the_upstream_connection(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_streams_keep_the_connection(make, fake)


async def test_n2_fans_out(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_n2(make, fake, native=False)


async def test_json_schema_native_via_output_config(make: cc.Make, fake: FakeAnthropic) -> None:
    body = await cc.check_json_schema(make, fake, level=Enforcement.VALIDATED)
    wire = body["output_config"]["format"]
    assert wire["type"] == "json_schema"
    assert wire["schema"]["additionalProperties"] is False
    assert set(wire["schema"]["properties"]) == {"name", "age"}


async def test_json_schema_fully_enforced_is_native(make: cc.Make, fake: FakeAnthropic) -> None:
    fake.answers.append(json.dumps({"tags": ["a", "b"]}))
    backend = await make()
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}}
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(JsonSchemaConstraint(schema)))
    )
    assert result.enforcement == Enforcement.NATIVE
    assert json.loads(result.generations[0].text) == {"tags": ["a", "b"]}


async def test_choice_native_wrapped_and_unwrapped(make: cc.Make, fake: FakeAnthropic) -> None:
    fake.answers.append(json.dumps({"value": "blue"}))
    backend = await make()
    structured = StructuredOutput(ChoiceConstraint(("red", "blue")))
    result = await backend.generate(cc.prompt("Colour?", structured_output=structured))
    assert result.generations[0].text == "blue"
    assert result.enforcement == Enforcement.NATIVE
    schema = fake.server.requests[0].body["output_config"]["format"]["schema"]
    assert schema["properties"]["value"]["enum"] == ["red", "blue"]


async def test_regex_validated_and_reasked(make: cc.Make, fake: FakeAnthropic) -> None:
    fake.answers.extend(["call me at 555", "555-1234"])
    backend = await make()
    structured = StructuredOutput(RegexConstraint(r"\d{3}-\d{4}"))
    result = await backend.generate(cc.prompt("Number?", structured_output=structured))
    assert result.generations[0].text == "555-1234"
    assert result.enforcement == Enforcement.VALIDATED
    first = fake.server.requests[0].body
    assert "output_config" not in first and "regular expression" in first["system"]


async def test_reask_never_returns_invalid(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_reask(make, fake)


async def test_grammar_refused_up_front(make: cc.Make, fake: FakeAnthropic) -> None:
    backend = await make()
    structured = StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, 'start: "a"'))
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(cc.prompt(structured_output=structured))
    assert "grammar" in info.value.message and "Anthropic" in info.value.message
    assert fake.server.requests == []


async def test_429_retry_then_success(make: cc.Make, fake: FakeAnthropic) -> None:
    body = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    await cc.check_429_then_success(make, fake, body)
    await cc.check_429_exhausted(make, fake, body)


async def test_persistent_500_unavailable(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_500_unavailable(
        make, fake, {"type": "error", "error": {"type": "api_error", "message": "x"}}
    )


async def test_timeout_and_deadline(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_timeout(make, fake)
    await cc.check_deadline(make, fake)


async def test_hang_up_is_retried(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_hang_up(make, fake)


async def test_unreachable_upstream(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_unreachable(make, fake)


async def test_long_headers(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_long_headers(make, fake)


async def test_bad_key_internal_without_key(
    make: cc.Make, fake: FakeAnthropic, caplog: pytest.LogCaptureFixture
) -> None:
    await cc.check_bad_key(make, fake, caplog, "sk-ant-wrong-key-abcdef0123456789")


async def test_cancel_closes_upstream(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_cancel_closes_upstream(make, fake)


async def test_task_cancel_closes_upstream(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_task_cancel_closes_upstream(make, fake)


async def test_broken_stream_and_malformed_body(make: cc.Make, fake: FakeAnthropic) -> None:
    await cc.check_broken_stream(make, fake)
    fake.reset()
    await cc.check_malformed(make, fake)


async def test_system_stop_and_refusal(make: cc.Make, fake: FakeAnthropic) -> None:
    fake.stop_reason = "refusal"
    backend = await make()
    from gengate.domain import ChatMessage, GenerationRequest, Role, StoppingCriteria, TextPart

    req = GenerationRequest(
        model="m",
        messages=(
            ChatMessage(Role.SYSTEM, (TextPart("Be brief."),)),
            ChatMessage(Role.USER, (TextPart("Hi"),)),
        ),
        stopping=StoppingCriteria(max_tokens=50, stop=("END",)),
    )
    result = await backend.generate(req)
    assert result.generations[0].finish_reason == FinishReason.REFUSAL
    body = fake.server.requests[0].body
    assert body["system"] == "Be brief." and body["stop_sequences"] == ["END"] and body["max_tokens"] == 50
