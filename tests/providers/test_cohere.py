"""Cohere backend driven through the real `cohere` SDK (AsyncClientV2) against a loopback v2 Chat API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("cohere", reason="the cohere SDK is not installed (extra: gengate[cohere])")

import contract_checks as cc
from fake_cohere import API_KEY, FakeCohere
from gengate import errors
from gengate.domain import (
    ChoiceConstraint,
    Enforcement,
    FinishReason,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    RegexConstraint,
    SamplingParams,
    StructuredOutput,
)
from gengate.providers.cohere import CohereBackend


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeCohere]:
    yield from cc.serving(FakeCohere())


@pytest.fixture
async def make(fake: FakeCohere) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        CohereBackend, "command", fake, model="command-test", base_url=fake.server.base_url, api_key=API_KEY
    ) as build:
        yield build


async def test_text(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_text(make, fake)
    body = fake.server.requests[0].body
    assert body["messages"] == [{"role": "user", "content": "Say hello"}]
    assert body["stream"] is False


async def test_stream_usage_in_final_frame(make: cc.Make, fake: FakeCohere) -> None:
    events = await cc.check_stream(make, fake)
    # Cohere's `tokens` count (what the model saw) wins over billed units: the fake adds 7.
    prompt_tokens = len(json.dumps(fake.server.requests[0].body["messages"][0]).split())
    assert events[-1].usage.input_tokens == prompt_tokens + 7  # type: ignore[union-attr]


async def test_streams_keep_the_upstream_connection(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_streams_keep_the_connection(make, fake)


async def test_n2_fans_out(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_n2(make, fake, native=False)


async def test_json_schema_native_via_response_format(make: cc.Make, fake: FakeCohere) -> None:
    body = await cc.check_json_schema(make, fake, level=Enforcement.NATIVE)
    assert body["response_format"] == {"type": "json_object", "json_schema": cc.PERSON}


async def test_json_object_and_choice_native(make: cc.Make, fake: FakeCohere) -> None:
    fake.answers.extend(['{"a": 1}', '{"value": "no"}'])
    backend = await make()
    result = await backend.generate(cc.prompt(structured_output=StructuredOutput(JsonObjectConstraint())))
    assert json.loads(result.generations[0].text) == {"a": 1}
    assert fake.server.requests[0].body["response_format"] == {"type": "json_object"}
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(ChoiceConstraint(("yes", "no"))))
    )
    assert result.generations[0].text == "no" and result.enforcement == Enforcement.NATIVE
    schema = fake.server.requests[1].body["response_format"]["json_schema"]
    assert schema["properties"]["value"]["enum"] == ["yes", "no"]


async def test_regex_validated(make: cc.Make, fake: FakeCohere) -> None:
    fake.answers.extend(["nope", "AB-12"])
    backend = await make()
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(RegexConstraint(r"[A-Z]{2}-\d{2}")))
    )
    assert result.generations[0].text == "AB-12" and result.enforcement == Enforcement.VALIDATED
    assert fake.server.requests[0].body["messages"][0]["role"] == "system"


async def test_reask_never_returns_invalid(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_reask(make, fake)


async def test_grammar_refused_up_front(make: cc.Make, fake: FakeCohere) -> None:
    backend = await make()
    structured = StructuredOutput(GrammarConstraint(GrammarSyntax.GBNF, 'root ::= "a"'))
    with pytest.raises(errors.Unimplemented, match="Cohere"):
        await backend.generate(cc.prompt(structured_output=structured))
    assert fake.server.requests == []


async def test_sampling_and_finish_reasons(make: cc.Make, fake: FakeCohere) -> None:
    fake.finish_reason = "MAX_TOKENS"
    backend = await make()
    result = await backend.generate(cc.prompt(sampling=SamplingParams(temperature=0.2, top_k=5, seed=7)))
    assert result.generations[0].finish_reason == FinishReason.LENGTH
    body = fake.server.requests[0].body
    assert (body["temperature"], body["k"], body["seed"]) == (0.2, 5, 7)


async def test_429_retry_then_success(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_429_then_success(make, fake, {"message": "too many requests"})
    await cc.check_429_exhausted(make, fake, {"message": "too many requests"})


async def test_persistent_500_unavailable(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_500_unavailable(make, fake, {"message": "internal"})


async def test_timeout_and_deadline(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_timeout(make, fake)
    await cc.check_deadline(make, fake)


async def test_hang_up_is_retried(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_hang_up(make, fake)


async def test_unreachable_upstream(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_unreachable(make, fake)


async def test_long_headers(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_long_headers(make, fake)


async def test_bad_key_internal_without_key(
    make: cc.Make, fake: FakeCohere, caplog: pytest.LogCaptureFixture
) -> None:
    await cc.check_bad_key(make, fake, caplog, "co-wrong-key-abcdef0123456789")


async def test_cancel_closes_upstream(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_cancel_closes_upstream(make, fake)


async def test_task_cancel_closes_upstream(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_task_cancel_closes_upstream(make, fake)


async def test_broken_stream_and_malformed_body(make: cc.Make, fake: FakeCohere) -> None:
    await cc.check_broken_stream(make, fake)
    fake.reset()
    await cc.check_malformed(make, fake)
