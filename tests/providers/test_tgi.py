"""TGI backend driven through the real `huggingface_hub` AsyncInferenceClient against a loopback TGI."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("huggingface_hub", reason="huggingface_hub is not installed (extra: gengate[tgi])")

import contract_checks as cc
from fake_tgi import API_KEY, FakeTGI
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
    StoppingCriteria,
    StructuredOutput,
    TextPart,
)
from gengate.providers.tgi import TGIBackend, TGIOptions


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeTGI]:
    yield from cc.serving(FakeTGI())


@pytest.fixture
async def make(fake: FakeTGI) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        TGIBackend, "tgi", fake, model="tgi-test", base_url=fake.server.base_url, api_key=API_KEY
    ) as build:
        yield build


def chat(text: str, **kw: Any) -> GenerationRequest:
    return GenerationRequest(model="m", messages=(ChatMessage(Role.USER, (TextPart(text),)),), **kw)


async def test_text(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_text(make, fake)
    body = fake.server.requests[0].body
    assert body["inputs"] == "Say hello" and body["parameters"]["details"] is True


async def test_stream_usage_in_final_frame(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_stream(make, fake)
    assert fake.server.requests[0].body["stream"] is True


async def test_streams_keep_the_upstream_connection(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_streams_keep_the_connection(make, fake)


async def test_chat_streams_keep_the_upstream_connection(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_streams_keep_the_connection(make, fake, chat("Say hello"))  # ends in [DONE]


async def test_chat_route_text_and_stream(make: cc.Make, fake: FakeTGI) -> None:
    fake.answers.extend(["chat reply here", "streamed chat reply"])
    backend = await make()
    result = await backend.generate(chat("Hi"))
    assert result.generations[0].text == "chat reply here"
    assert result.usage.output_tokens == 3
    events = await cc.collect(backend.generate_stream(chat("Hi")))
    assert "".join(getattr(e, "text", "") for e in events) == "streamed chat reply"
    assert events[-1].usage.output_tokens == 3  # type: ignore[union-attr]
    assert [r.path for r in fake.server.requests] == ["/v1/chat/completions"] * 2


async def test_n2_fans_out(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_n2(make, fake, native=False)


async def test_json_schema_native_grammar(make: cc.Make, fake: FakeTGI) -> None:
    body = await cc.check_json_schema(make, fake, level=Enforcement.NATIVE)
    assert body["parameters"]["grammar"] == {"type": "json", "value": cc.PERSON}


async def test_json_schema_on_chat_route(make: cc.Make, fake: FakeTGI) -> None:
    fake.answers.append('{"name": "Bo", "age": 2}')
    backend = await make()
    result = await backend.generate(
        chat("Who?", structured_output=StructuredOutput(JsonSchemaConstraint(cc.PERSON)))
    )
    assert json.loads(result.generations[0].text) == {"name": "Bo", "age": 2}
    assert fake.server.requests[0].body["response_format"] == {"type": "json", "value": cc.PERSON}


async def test_regex_and_choice_native_grammar(make: cc.Make, fake: FakeTGI) -> None:
    fake.answers.extend(["AB-12", "b.c"])
    backend = await make()
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(RegexConstraint(r"[A-Z]{2}-\d{2}")))
    )
    assert result.generations[0].text == "AB-12" and result.enforcement == Enforcement.NATIVE
    assert fake.server.requests[0].body["parameters"]["grammar"] == {
        "type": "regex",
        "value": "[A-Z]{2}-[0-9]{2}",  # sent in the ASCII dialect
    }
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(ChoiceConstraint(("a", "b.c"))))
    )
    assert result.generations[0].text == "b.c"
    assert fake.server.requests[1].body["parameters"]["grammar"] == {
        "type": "regex",
        "value": r"(?:a)|(?:b\.c)",
    }


async def test_invalid_native_output_is_never_returned(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_reask(make, fake)


async def test_lark_grammar_refused_up_front(make: cc.Make, fake: FakeTGI) -> None:
    backend = await make()
    structured = StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, 'start: "a"'))
    with pytest.raises(errors.Unimplemented, match="TGI"):
        await backend.generate(cc.prompt(structured_output=structured))
    assert fake.server.requests == []


async def test_logprobs_and_finish(make: cc.Make, fake: FakeTGI) -> None:
    fake.answers.append("x y")
    fake.generate_finish = "length"
    backend = await make()
    result = await backend.generate(cc.prompt(logprobs=1))
    g = result.generations[0]
    assert g.finish_reason == FinishReason.LENGTH
    assert g.logprobs is not None and [t.token for t in g.logprobs] == ["x", " y"]
    assert g.logprobs[0].logprob == -0.5 and g.logprobs[0].token_id == 100


async def test_429_retry_then_success(make: cc.Make, fake: FakeTGI) -> None:
    body = {"error": "Model is overloaded", "error_type": "overloaded"}
    await cc.check_429_then_success(make, fake, body)
    await cc.check_429_exhausted(make, fake, body)


async def test_persistent_500_unavailable(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_500_unavailable(make, fake, {"error": "CUDA error", "error_type": "generation"})


async def test_timeout_and_deadline(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_timeout(make, fake)
    await cc.check_deadline(make, fake)


async def test_hang_up_is_retried(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_hang_up(make, fake)


async def test_unreachable_upstream(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_unreachable(make, fake)


async def test_long_headers(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_long_headers(make, fake)


async def test_bad_key_internal_without_key(
    make: cc.Make, fake: FakeTGI, caplog: pytest.LogCaptureFixture
) -> None:
    await cc.check_bad_key(make, fake, caplog, "hf_wrongtoken0123456789abcdef")


async def test_cancel_closes_upstream(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_cancel_closes_upstream(make, fake)


async def test_task_cancel_closes_upstream(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_task_cancel_closes_upstream(make, fake)


async def test_broken_stream_and_malformed_body(make: cc.Make, fake: FakeTGI) -> None:
    await cc.check_broken_stream(make, fake)
    fake.reset()
    await cc.check_malformed(make, fake)


async def test_stored_hf_token_is_never_sent(
    fake: FakeTGI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A token saved by `huggingface-cli login` must not travel to whatever endpoint is configured.
    stored = "hf_storedtokenthatmustnotleak"
    token_file = tmp_path / "token"
    token_file.write_text(stored)  # as `hf auth login` leaves it
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(token_file))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    fake.reset()
    backend = TGIBackend("tgi", TGIOptions(model="tgi-test", base_url=fake.server.base_url, timeout=5.0))
    await backend.start()
    try:
        with contextlib.suppress(errors.GengateError):
            await backend.generate(
                GenerationRequest(model="m", prompt="hi", stopping=StoppingCriteria(max_tokens=4))
            )
    finally:
        await backend.aclose()
    assert fake.server.requests, "the request never reached the fake"
    assert huggingface_hub.get_token() == stored  # the fallback really had a token to leak
    assert all(stored not in str(r.headers) for r in fake.server.requests)
