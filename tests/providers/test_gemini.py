"""Gemini backend driven through the real `google-genai` SDK against a loopback Gemini API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("google.genai", reason="the google-genai SDK is not installed (extra: gengate[gemini])")

import contract_checks as cc
from fake_gemini import API_KEY, FakeGemini
from gengate import errors
from gengate.domain import (
    ChatMessage,
    ChoiceConstraint,
    Enforcement,
    FinishReason,
    GenerationRequest,
    GrammarConstraint,
    GrammarSyntax,
    JsonSchemaConstraint,
    RegexConstraint,
    Role,
    StructuredOutput,
    TextPart,
)
from gengate.providers.gemini import GeminiBackend


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeGemini]:
    yield from cc.serving(FakeGemini())


@pytest.fixture
async def make(fake: FakeGemini) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        GeminiBackend, "gemini", fake, model="gemini-test", base_url=fake.server.base_url, api_key=API_KEY
    ) as build:
        yield build


async def test_text(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_text(make, fake)
    rec = fake.server.requests[0]
    assert rec.path.endswith("/models/gemini-test:generateContent")
    assert rec.body["contents"] == [{"role": "user", "parts": [{"text": "Say hello"}]}]


async def test_stream_usage_in_final_frame(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_stream(make, fake)
    rec = fake.server.requests[0]
    assert rec.path.endswith(":streamGenerateContent") and rec.query.get("alt") == "sse"


async def test_n2_native_candidate_count(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_n2(make, fake, native=True)
    assert fake.server.requests[0].body["generationConfig"]["candidateCount"] == 2


async def test_json_schema_native_response_json_schema(make: cc.Make, fake: FakeGemini) -> None:
    body = await cc.check_json_schema(make, fake, level=Enforcement.NATIVE)
    config = body["generationConfig"]
    assert config["responseMimeType"] == "application/json"
    assert config["responseJsonSchema"] == cc.PERSON


async def test_schema_outside_subset_is_validated(make: cc.Make, fake: FakeGemini) -> None:
    fake.answers.extend(['{"code": "x"}', '{"code": "AB"}'])
    backend = await make()
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}}
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(JsonSchemaConstraint(schema)))
    )
    assert json.loads(result.generations[0].text) == {"code": "AB"}
    assert result.enforcement == Enforcement.VALIDATED
    assert len(fake.server.requests) == 2  # the first answer broke `pattern`: re-asked


async def test_choice_native_text_enum(make: cc.Make, fake: FakeGemini) -> None:
    fake.answers.append("blue")
    backend = await make()
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(ChoiceConstraint(("red", "blue"))))
    )
    assert result.generations[0].text == "blue" and result.enforcement == Enforcement.NATIVE
    config = fake.server.requests[0].body["generationConfig"]
    assert config["responseMimeType"] == "text/x.enum"
    assert config["responseSchema"]["enum"] == ["red", "blue"]


async def test_regex_validated(make: cc.Make, fake: FakeGemini) -> None:
    fake.answers.extend(["nope", "AB-12"])
    backend = await make()
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(RegexConstraint(r"[A-Z]{2}-\d{2}")))
    )
    assert result.generations[0].text == "AB-12" and result.enforcement == Enforcement.VALIDATED
    assert "regular expression" in json.dumps(fake.server.requests[0].body["systemInstruction"])


async def test_reask_never_returns_invalid(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_reask(make, fake)


async def test_grammar_refused_up_front(make: cc.Make, fake: FakeGemini) -> None:
    backend = await make()
    structured = StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, 'start: "a"'))
    with pytest.raises(errors.Unimplemented, match="Gemini"):
        await backend.generate(cc.prompt(structured_output=structured))
    assert fake.server.requests == []


async def test_chat_roles_and_safety_finish(make: cc.Make, fake: FakeGemini) -> None:
    fake.finish_reason = "SAFETY"
    backend = await make()
    req = GenerationRequest(
        model="m",
        messages=(
            ChatMessage(Role.SYSTEM, (TextPart("Be brief."),)),
            ChatMessage(Role.USER, (TextPart("Hi"),)),
            ChatMessage(Role.ASSISTANT, (TextPart("Hello"),)),
            ChatMessage(Role.USER, (TextPart("Again"),)),
        ),
    )
    result = await backend.generate(req)
    assert result.generations[0].finish_reason == FinishReason.CONTENT_FILTER
    body = fake.server.requests[0].body
    assert [c["role"] for c in body["contents"]] == ["user", "model", "user"]
    assert body["systemInstruction"]["parts"] == [{"text": "Be brief."}]


async def test_429_retry_then_success(make: cc.Make, fake: FakeGemini) -> None:
    body = {"error": {"code": 429, "message": "Resource has been exhausted", "status": "RESOURCE_EXHAUSTED"}}
    await cc.check_429_then_success(make, fake, body)
    await cc.check_429_exhausted(make, fake, body)


async def test_429_retry_info_in_body(make: cc.Make, fake: FakeGemini) -> None:
    from fakehttp import Fault

    body = {
        "error": {
            "code": 429,
            "message": "quota",
            "status": "RESOURCE_EXHAUSTED",
            "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "12s"}],
        }
    }
    fake.server.fail_next(Fault(status=429, body=body))
    backend = await make(max_retries=0)
    with pytest.raises(errors.ResourceExhausted) as info:
        await backend.generate(cc.prompt())
    assert info.value.retry_after_s == 12.0


async def test_persistent_500_unavailable(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_500_unavailable(make, fake, {"error": {"code": 500, "message": "x", "status": "INTERNAL"}})


async def test_timeout_and_deadline(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_timeout(make, fake)
    await cc.check_deadline(make, fake)


async def test_bad_key_internal_without_key(
    make: cc.Make, fake: FakeGemini, caplog: pytest.LogCaptureFixture
) -> None:
    # Google answers a bad key with HTTP 400 INVALID_ARGUMENT "API key not valid": mapped by meaning.
    await cc.check_bad_key(make, fake, caplog, "AIzaSyWrongKey0123456789abcdefghijk")


async def test_cancel_closes_upstream(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_cancel_closes_upstream(make, fake)


async def test_task_cancel_closes_upstream(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_task_cancel_closes_upstream(make, fake)


async def test_broken_stream_and_malformed_body(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_broken_stream(make, fake)
    fake.reset()
    await cc.check_malformed(make, fake)
