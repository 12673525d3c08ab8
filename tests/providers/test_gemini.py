"""Gemini backend driven through the real `google-genai` SDK against a loopback Gemini API."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
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
    GenerationDelta,
    GenerationEnd,
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


async def test_streams_keep_the_upstream_connection(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_streams_keep_the_connection(make, fake)


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


async def test_hang_up_is_retried(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_hang_up(make, fake)


async def test_unreachable_upstream(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_unreachable(make, fake)


async def test_long_headers(make: cc.Make, fake: FakeGemini) -> None:
    await cc.check_long_headers(make, fake)


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


# --- the raw path: continuation as the SDK follows it, errors as the SDK raised them ------------


@contextlib.asynccontextmanager
async def sdk_client(fake: FakeGemini, *, stream: bool = False) -> AsyncIterator[Any]:
    """google-genai itself on the fake: what the backend did before its raw path (unary through
    the SDK's default transport, aiohttp; a stream through an httpx client of its own)."""
    from google import genai
    from google.genai import types

    async with httpx.AsyncClient() as http:
        options = types.HttpOptions(
            base_url=fake.server.base_url, httpx_async_client=http if stream else None
        )
        client = genai.Client(api_key=API_KEY, http_options=options)
        try:
            yield client
        finally:
            await client.aio.aclose()


SAID = [{"role": "user", "parts": [{"text": "Say hello"}]}]  # cc.prompt() as the backend sends it
LONG = "one two three four five six seven"


def tokens_sent(fake: FakeGemini) -> list[Any]:
    return [r.body.get("continuationToken") for r in fake.server.requests]


async def test_continuation_unary_is_followed_and_merged_as_the_sdk_does(
    make: cc.Make, fake: FakeGemini
) -> None:
    fake.hop_words = 3
    fake.answers.append(LONG)
    async with sdk_client(fake) as client:
        sdk = await client.aio.models.generate_content(model="gemini-test", contents=SAID)
    assert sdk.text == LONG and len(fake.server.requests) == 3
    expected = tokens_sent(fake)
    fake.reset()
    fake.hop_words = 3
    fake.answers.append(LONG)
    result = await (await make()).generate(cc.prompt())
    g = result.generations[0]
    assert (g.text, g.finish_reason) == (LONG, FinishReason.STOP)
    meta = sdk.usage_metadata
    assert meta is not None and meta.prompt_token_count is not None
    # Each hop bills the prompt again; the SDK sums the hops' counts, and so does gengate.
    assert (result.usage.input_tokens, result.usage.output_tokens) == (
        meta.prompt_token_count,
        meta.candidates_token_count,
    )
    # Each hop after the first sends back the token the one before gave, as the SDK sent it.
    assert tokens_sent(fake) == expected and expected[0] is None and None not in expected[1:]


async def test_continuation_streamed_flows_across_hops_as_the_sdk_does(
    make: cc.Make, fake: FakeGemini
) -> None:
    for checkpoints in (False, True):
        fake.reset()
        fake.hop_words, fake.checkpoints = 2, checkpoints
        fake.answers.append(LONG)
        sdk_text, sdk_usage, sdk_finishes = "", None, []
        async with sdk_client(fake, stream=True) as client:
            chunks = await client.aio.models.generate_content_stream(model="gemini-test", contents=SAID)
            async for chunk in chunks:
                sdk_text += chunk.text or ""
                sdk_usage = chunk.usage_metadata or sdk_usage
                sdk_finishes += [c.finish_reason for c in chunk.candidates or () if c.finish_reason]
        assert sdk_text == LONG and len(sdk_finishes) == 1 and sdk_usage is not None
        fake.reset()
        fake.hop_words, fake.checkpoints = 2, checkpoints
        fake.answers.append(LONG)
        events = await cc.collect((await make()).generate_stream(cc.prompt()))
        assert "".join(e.text for e in events if isinstance(e, GenerationDelta)) == LONG
        ends = [e for e in events if isinstance(e, GenerationEnd)]
        assert [e.finish_reason for e in ends] == [FinishReason.STOP], checkpoints
        assert (ends[0].usage.input_tokens, ends[0].usage.output_tokens) == (
            sdk_usage.prompt_token_count,
            sdk_usage.candidates_token_count,
        )
        assert len(fake.server.requests) == 4  # 7 words, 2 a hop


async def test_a_broken_stream_resumes_from_its_checkpoint_as_the_sdk_does(
    make: cc.Make, fake: FakeGemini
) -> None:
    from fakehttp import Fault

    def broken_after_three_words() -> None:
        fake.reset()
        fake.hop_words, fake.checkpoints = 100, True  # one hop, a checkpoint on every chunk
        fake.answers.append(LONG)
        fake.server.fail_next(Fault(break_after=3))  # the connection drops after three words

    broken_after_three_words()
    async with sdk_client(fake, stream=True) as client:
        chunks = await client.aio.models.generate_content_stream(model="gemini-test", contents=SAID)
        assert "".join([c.text or "" async for c in chunks]) == LONG
    sdk_tokens = tokens_sent(fake)
    broken_after_three_words()
    events = await cc.collect((await make(max_retries=0)).generate_stream(cc.prompt()))
    assert "".join(e.text for e in events if isinstance(e, GenerationDelta)) == LONG
    assert [e.finish_reason for e in events if isinstance(e, GenerationEnd)] == [FinishReason.STOP]
    assert tokens_sent(fake) == sdk_tokens and len(sdk_tokens) == 2
    assert base64.urlsafe_b64decode(sdk_tokens[1]) == base64.b64decode(FakeGemini.token(1, 3))
    # Without a checkpoint there is nothing to resume from: the break is an error, as before.
    fake.reset()
    fake.answers.append(LONG)
    fake.server.fail_next(Fault(break_after=3))
    with pytest.raises(errors.GengateError):
        await cc.collect((await make(max_retries=0)).generate_stream(cc.prompt()))
    assert len(fake.server.requests) == 1


async def test_an_endless_continuation_ends_at_the_hop_limit(
    make: cc.Make, fake: FakeGemini, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gengate.providers import gemini_raw
    from gengate.providers.errors import UPSTREAM_BAD_RESPONSE

    monkeypatch.setattr(gemini_raw, "MAX_HOPS", 5)
    fake.endless = True
    backend = await make(max_retries=0)
    for call in (backend.generate(cc.prompt()), cc.collect(backend.generate_stream(cc.prompt()))):
        fake.server.reset()
        with pytest.raises(errors.Unavailable) as info:
            await call
        assert info.value.reason == UPSTREAM_BAD_RESPONSE
        assert "past gengate's limit of 5 requests" in info.value.message
        assert len(fake.server.requests) == 5


async def test_a_malformed_chunk_is_an_error_even_where_the_stream_could_resume(
    make: cc.Make, fake: FakeGemini
) -> None:
    """A chunk gengate cannot read ends the stream with UPSTREAM_BAD_RESPONSE. Resuming from the
    checkpoint it carried would skip its content silently: only a failed transport resumes."""
    from gengate.providers.errors import UPSTREAM_BAD_RESPONSE

    fake.hop_words, fake.checkpoints, fake.bad_chunk = 100, True, 2
    fake.answers.append(LONG)
    with pytest.raises(errors.Unavailable) as info:
        await cc.collect((await make(max_retries=0)).generate_stream(cc.prompt()))
    assert info.value.reason == UPSTREAM_BAD_RESPONSE and "`text` is a number" in info.value.message
    assert len(fake.server.requests) == 1  # not resumed


async def test_a_continued_answer_is_bounded_in_all_its_hops(
    make: cc.Make, fake: FakeGemini, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merged answer holds every hop's text: the body limit counts them together, so a hostile
    upstream cannot make gengate hold MAX_HOPS bodies of the limit each."""
    from gengate.providers import rawhttp
    from gengate.providers.errors import UPSTREAM_BAD_RESPONSE

    fake.hop_words = 3
    fake.answers.append(LONG)
    # A hop's body here is ~300 bytes (three words, usage, a token): one fits, two do not.
    monkeypatch.setattr(rawhttp, "MAX_BODY_BYTES", 450)
    with pytest.raises(errors.Unavailable) as info:
        await (await make(max_retries=0)).generate(cc.prompt())
    assert info.value.reason == UPSTREAM_BAD_RESPONSE
    assert f"continued over {len(fake.server.requests)} requests" in info.value.message
    assert len(fake.server.requests) > 1


async def test_a_continuation_left_without_a_token_is_length(make: cc.Make, fake: FakeGemini) -> None:
    from fakehttp import Fault

    body = {"candidates": [{"content": {"parts": [{"text": "cut"}]}, "finishReason": "CONTINUATION"}]}
    fake.server.fail_next(Fault(status=200, body=body))
    result = await (await make()).generate(cc.prompt())
    assert result.generations[0].finish_reason == FinishReason.LENGTH and len(fake.server.requests) == 1


STATUS_FAULTS = {
    "400": (400, {"error": {"code": 400, "message": "bad field x", "status": "INVALID_ARGUMENT"}}, {}, None),
    "429": (
        429,
        {"error": {"code": 429, "message": "Resource has been exhausted", "status": "RESOURCE_EXHAUSTED"}},
        {"retry-after": "7"},
        None,
    ),
    "503 json": (503, {"error": {"code": 503, "message": "overloaded", "status": "UNAVAILABLE"}}, {}, None),
    "503 html": (503, "<html>down</html>", {}, "text/html"),
}


@pytest.mark.parametrize("label", list(STATUS_FAULTS))
async def test_status_errors_map_as_the_sdk_raised_them(make: cc.Make, fake: FakeGemini, label: str) -> None:
    """400, 429 (retry-after), 503: the SDK's APIError, mapped, is the same error as before,
    unary and streamed (the SDK driven directly stands for before)."""
    from fakehttp import Fault
    from google.genai import errors as genai_errors

    status, body, headers, content_type = STATUS_FAULTS[label]

    def fault() -> Fault:
        return Fault(
            status=status, body=body, headers=headers, content_type=content_type or "application/json"
        )

    backend = await make(max_retries=0)

    def same(got: errors.GengateError, sdk: genai_errors.APIError) -> None:
        want = backend.normalize_error(sdk)
        assert type(got) is type(want), label
        assert (got.reason, got.message, got.retry_after_s) == (want.reason, want.message, want.retry_after_s)
        assert got.metadata == want.metadata

    fake.server.fail_next(fault())
    async with sdk_client(fake) as client:
        with pytest.raises(genai_errors.APIError) as sdk_info:
            await client.aio.models.generate_content(model="gemini-test", contents=SAID)
    fake.server.fail_next(fault())
    with pytest.raises(errors.GengateError) as info:
        await backend.generate(cc.prompt())
    same(info.value, sdk_info.value)
    async with sdk_client(fake, stream=True) as client:
        fake.server.fail_next(fault())
        with pytest.raises(genai_errors.APIError) as sdk_info:
            async for _ in await client.aio.models.generate_content_stream(
                model="gemini-test", contents=SAID
            ):
                pass
    fake.server.fail_next(fault())
    with pytest.raises(errors.GengateError) as info:
        await cc.collect(backend.generate_stream(cc.prompt()))
    same(info.value, sdk_info.value)


async def test_an_error_event_mid_stream_is_the_sdks_error(make: cc.Make, fake: FakeGemini) -> None:
    from fakehttp import Fault

    hey = {"candidates": [{"content": {"parts": [{"text": "Hey"}], "role": "model"}, "index": 0}]}
    quota = {"error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED"}}
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in (hey, quota))
    fake.server.fail_next(Fault(status=200, body=sse, content_type="text/event-stream"))
    with pytest.raises(errors.ResourceExhausted, match="quota"):
        await cc.collect((await make(max_retries=0)).generate_stream(cc.prompt()))
