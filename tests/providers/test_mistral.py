"""Mistral backend driven through the real `mistralai` SDK against a loopback chat-completions API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("mistralai", reason="the mistralai SDK is not installed (extra: gengate[mistral])")

import contract_checks as cc
from fake_mistral import API_KEY, FakeMistral
from gengate import errors
from gengate.domain import (
    ChoiceConstraint,
    Enforcement,
    FinishReason,
    GenerationEnd,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    RegexConstraint,
    SamplingParams,
    StructuredOutput,
)
from gengate.providers.mistral import MistralBackend
from mistral_bytes import same_bytes_as_the_sdk  # noqa: F401  (autouse: every body checked)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeMistral]:
    yield from cc.serving(FakeMistral())


@pytest.fixture
async def make(fake: FakeMistral) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        MistralBackend, "mistral", fake, model="mistral-test", base_url=fake.server.base_url, api_key=API_KEY
    ) as build:
        yield build


async def test_text(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_text(make, fake)
    assert fake.server.requests[0].body["messages"] == [{"role": "user", "content": "Say hello"}]


async def test_stream_usage_in_final_frame(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_stream(make, fake)
    assert fake.server.requests[0].body["stream"] is True


async def test_streams_keep_the_upstream_connection(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_streams_keep_the_connection(make, fake)


async def test_n2_native(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_n2(make, fake, native=True)
    assert fake.server.requests[0].body["n"] == 2


async def test_stream_n2_native_usage_split(make: cc.Make, fake: FakeMistral) -> None:
    fake.answers.extend(["a b", "c d e"])
    backend = await make()
    events = await cc.collect(backend.generate_stream(cc.prompt(n=2)))
    ends = {e.index: e for e in events if isinstance(e, GenerationEnd)}
    assert sorted(ends) == [0, 1]
    assert ends[0].usage.output_tokens + ends[1].usage.output_tokens == 5
    assert len(fake.server.requests) == 1


async def test_json_schema_native_via_response_format(make: cc.Make, fake: FakeMistral) -> None:
    body = await cc.check_json_schema(make, fake, level=Enforcement.NATIVE)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": cc.PERSON, "strict": True},
    }


async def test_json_object_and_choice_native(make: cc.Make, fake: FakeMistral) -> None:
    fake.answers.extend(['{"a": 1}', '{"value": "no"}'])
    backend = await make()
    result = await backend.generate(cc.prompt(structured_output=StructuredOutput(JsonObjectConstraint())))
    assert json.loads(result.generations[0].text) == {"a": 1}
    assert fake.server.requests[0].body["response_format"] == {"type": "json_object"}
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(ChoiceConstraint(("yes", "no"))))
    )
    assert result.generations[0].text == "no" and result.enforcement == Enforcement.NATIVE


async def test_regex_validated(make: cc.Make, fake: FakeMistral) -> None:
    fake.answers.extend(["nope", "AB-12"])
    backend = await make()
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(RegexConstraint(r"[A-Z]{2}-\d{2}")))
    )
    assert result.generations[0].text == "AB-12" and result.enforcement == Enforcement.VALIDATED


async def test_reask_never_returns_invalid(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_reask(make, fake)


async def test_grammar_refused_up_front(make: cc.Make, fake: FakeMistral) -> None:
    backend = await make()
    structured = StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, 'start: "a"'))
    with pytest.raises(errors.Unimplemented, match="Mistral"):
        await backend.generate(cc.prompt(structured_output=structured))
    assert fake.server.requests == []


async def test_sampling_and_finish_reasons(make: cc.Make, fake: FakeMistral) -> None:
    fake.finish_reason = "length"
    backend = await make()
    result = await backend.generate(cc.prompt(sampling=SamplingParams(temperature=0.3, seed=11)))
    assert result.generations[0].finish_reason == FinishReason.LENGTH
    body = fake.server.requests[0].body
    assert (body["temperature"], body["random_seed"]) == (0.3, 11)


async def test_429_retry_then_success(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_429_then_success(make, fake, {"message": "Requests rate limit exceeded"})
    await cc.check_429_exhausted(make, fake, {"message": "Requests rate limit exceeded"})


async def test_persistent_500_unavailable(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_500_unavailable(make, fake, {"message": "internal"})


async def test_timeout_and_deadline(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_timeout(make, fake)
    await cc.check_deadline(make, fake)


async def test_hang_up_is_retried(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_hang_up(make, fake)


async def test_unreachable_upstream(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_unreachable(make, fake)


async def test_long_headers(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_long_headers(make, fake)


async def test_bad_key_internal_without_key(
    make: cc.Make, fake: FakeMistral, caplog: pytest.LogCaptureFixture
) -> None:
    await cc.check_bad_key(make, fake, caplog, "mistral-wrong-key-abcdef0123456789")


async def test_cancel_closes_upstream(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_cancel_closes_upstream(make, fake)


async def test_task_cancel_closes_upstream(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_task_cancel_closes_upstream(make, fake)


async def test_broken_stream_and_malformed_body(make: cc.Make, fake: FakeMistral) -> None:
    await cc.check_broken_stream(make, fake)
    fake.reset()
    await cc.check_malformed(make, fake)
