"""LiteLLM backend: the real `litellm` library routed ("openai/<x>" + base_url) to the loopback
OpenAI-compatible fake."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("litellm", reason="litellm is not installed (extra: gengate[litellm])")

import contract_checks as cc
from fake_openai import API_KEY, FakeOpenAI
from gengate import errors
from gengate.domain import (
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    RegexConstraint,
    StructuredOutput,
)
from gengate.providers.litellm import LiteLLMBackend


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    yield from cc.serving(FakeOpenAI())


@pytest.fixture
async def make(fake: FakeOpenAI) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        LiteLLMBackend,
        "lite",
        fake,
        model="openai/fake-gpt",
        base_url=fake.server.base_url + "/v1",
        api_key=API_KEY,
        response_schema=True,
    ) as build:
        yield build


async def test_text(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_text(make, fake)
    body = fake.server.requests[0].body
    assert body["model"] == "fake-gpt"
    assert body["messages"] == [{"role": "user", "content": "Say hello"}]


async def test_stream_usage_in_final_frame(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_stream(make, fake)
    assert fake.server.requests[0].body["stream"] is True


async def test_streams_keep_the_upstream_connection(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_streams_keep_the_connection(make, fake)


async def test_n2_native(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_n2(make, fake, native=True)
    assert fake.server.requests[0].body["n"] == 2


async def test_json_schema_native_when_litellm_says_so(make: cc.Make, fake: FakeOpenAI) -> None:
    body = await cc.check_json_schema(make, fake, level=Enforcement.NATIVE)
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"]["additionalProperties"] is False


async def test_capabilities_follow_litellm(make: cc.Make, fake: FakeOpenAI) -> None:
    unknown = await make(response_schema=None)  # LiteLLM does not know "openai/fake-gpt"
    caps = unknown.capabilities.constraints
    assert caps[ConstraintKind.JSON_SCHEMA] == Enforcement.VALIDATED
    assert caps[ConstraintKind.JSON_OBJECT] == Enforcement.NATIVE  # response_format is an openai param
    assert ConstraintKind.GRAMMAR not in caps
    known = await make(model="openai/gpt-4o-mini", response_schema=None)
    assert known.capabilities.constraints[ConstraintKind.JSON_SCHEMA] == Enforcement.NATIVE


async def test_validated_schema_when_not_native(make: cc.Make, fake: FakeOpenAI) -> None:
    fake.answers.extend(["not json", json.dumps({"name": "Al", "age": 1})])
    backend = await make(response_schema=False)
    from gengate.domain import JsonSchemaConstraint

    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(JsonSchemaConstraint(cc.PERSON)))
    )
    assert json.loads(result.generations[0].text) == {"name": "Al", "age": 1}
    assert result.enforcement == Enforcement.VALIDATED
    first = fake.server.requests[0].body
    assert "response_format" not in first and "JSON Schema" in first["messages"][0]["content"]


async def test_json_object_and_choice(make: cc.Make, fake: FakeOpenAI) -> None:
    fake.answers.extend(['{"a": 1}', '{"value": "no"}'])
    backend = await make()
    result = await backend.generate(cc.prompt(structured_output=StructuredOutput(JsonObjectConstraint())))
    assert json.loads(result.generations[0].text) == {"a": 1}
    assert fake.server.requests[0].body["response_format"] == {"type": "json_object"}
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(ChoiceConstraint(("yes", "no"))))
    )
    assert result.generations[0].text == "no"


async def test_regex_validated(make: cc.Make, fake: FakeOpenAI) -> None:
    fake.answers.extend(["nope", "AB-12"])
    backend = await make()
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(RegexConstraint(r"[A-Z]{2}-\d{2}")))
    )
    assert result.generations[0].text == "AB-12" and result.enforcement == Enforcement.VALIDATED


async def test_reask_never_returns_invalid(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_reask(make, fake)


async def test_grammar_refused_up_front(make: cc.Make, fake: FakeOpenAI) -> None:
    backend = await make()
    structured = StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, 'start: "a"'))
    with pytest.raises(errors.Unimplemented, match="LiteLLM"):
        await backend.generate(cc.prompt(structured_output=structured))
    assert fake.server.requests == []


async def test_429_retry_then_success(make: cc.Make, fake: FakeOpenAI) -> None:
    body = {"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}}
    await cc.check_429_then_success(make, fake, body)
    await cc.check_429_exhausted(make, fake, body)


async def test_persistent_500_unavailable(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_500_unavailable(make, fake, {"error": {"message": "boom", "type": "server_error"}})


async def test_timeout_and_deadline(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_timeout(make, fake)
    await cc.check_deadline(make, fake)


async def test_hang_up_is_retried(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_hang_up(make, fake)


async def test_unreachable_upstream(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_unreachable(make, fake)


async def test_long_headers(make: cc.Make, fake: FakeOpenAI) -> None:
    # LiteLLM builds its own aiohttp session, which reads header lines up to aiohttp's 8190 bytes.
    await cc.check_long_headers(make, fake, reads_20k=False)


async def test_bad_key_internal_without_key(
    make: cc.Make, fake: FakeOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    await cc.check_bad_key(make, fake, caplog, "sk-wrong-litellm-key-0123456789")


async def test_cancel_closes_upstream(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_cancel_closes_upstream(make, fake)


async def test_task_cancel_closes_upstream(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_task_cancel_closes_upstream(make, fake)


async def test_broken_stream_and_malformed_body(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_broken_stream(make, fake)
    fake.reset()
    await cc.check_malformed(make, fake)
