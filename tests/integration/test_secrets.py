"""Secrets never leave the server: API keys and caller tokens are redacted by value from error
messages, error details, logs and traces, before anything is cut to length."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "providers"))

from fake_openai import FakeOpenAI
from fakehttp import Fault, Recorded
from gengate import errors
from gengate.domain import GenerationRequest
from gengate.providers.openai import OpenAIBackend, OpenAIOptions
from gengate.redaction import MAX_LOG_MESSAGE, register_secret
from gengate.telemetry import RedactingSpanProcessor
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from grpc_status import rpc_status
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode
from pydantic import SecretStr

# No recognisable prefix (sk-, hf_, AIza...): only redaction by value can catch it.
KEY = "zq81hfKk2mMv0PX7qq1"
TOKEN = "Tq7vLw2pXc9rMz4bNk6s"  # a caller token, also without a prefix
MESSAGE_CUT = 1000  # where provider error texts are cut (providers/errors.py)


def pieces(secret: str, size: int = 6) -> list[str]:
    """Every `size`-character piece of `secret`: none may show, not even half a key."""
    return [secret[i : i + size] for i in range(len(secret) - size + 1)]


def leaked(secret: str, *texts: str | bytes) -> list[str]:
    found = []
    for text in texts:
        blob = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        found += [p for p in pieces(secret) if p in blob]
    return found


class KeyedFakeOpenAI(FakeOpenAI):
    """The OpenAI fake, accepting KEY as its API key."""

    @staticmethod
    def _auth(rec: Recorded) -> bool:
        return rec.headers.get("authorization", "") == f"Bearer {KEY}"


@pytest.fixture(scope="module")
def upstream() -> Iterator[KeyedFakeOpenAI]:
    fake = KeyedFakeOpenAI()
    fake.start()
    yield fake
    fake.stop()


def _config(fake: FakeOpenAI, **server: Any) -> dict[str, Any]:
    model = {
        "name": "remote",
        "backend": "openai",
        "model": "gpt-fake",
        "base_url": fake.server.base_url + "/v1",
        "api_key": KEY,
        "max_retries": 0,
    }
    return {"models": [model], "server": server}


def _echoing_body(offset: int) -> dict[str, Any]:
    """An error body without a message field (gengate falls back to its JSON) whose JSON text has
    KEY at `offset` of the error object, so KEY straddles the cut wherever the SDK starts it."""
    prefix = len('{"code": "server_error", "debug": "')
    return {"error": {"code": "server_error", "debug": "x" * (offset - prefix) + KEY + " trailing"}}


async def test_provider_error_is_redacted_before_it_is_cut(upstream: KeyedFakeOpenAI) -> None:
    """The provider's own message (what every later layer starts from) holds no piece of KEY."""
    upstream.reset()
    backend = OpenAIBackend(
        "remote",
        OpenAIOptions(
            model="gpt-fake", base_url=upstream.server.base_url + "/v1", api_key=SecretStr(KEY), max_retries=0
        ),
    )
    await backend.start()
    try:
        for offset in (MESSAGE_CUT - 15, MESSAGE_CUT - 5):
            upstream.server.fail_next(Fault(status=500, body=_echoing_body(offset)))
            with pytest.raises(errors.Unavailable) as caught:
                await backend.generate(GenerationRequest(model="remote", prompt="hi", request_id="r"))
            error = caught.value
            assert leaked(KEY, error.message, str(error), json.dumps(error.metadata)) == []
            assert "x" * 900 in error.message and error.message.endswith("…")  # cut, after redaction
    finally:
        await backend.aclose()


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
async def test_key_echoed_across_the_cut_never_reaches_the_caller_or_logs(
    make_server: Any, upstream: KeyedFakeOpenAI, caplog: pytest.LogCaptureFixture, rpc: str
) -> None:
    caplog.set_level(logging.DEBUG)
    upstream.reset()
    server = await make_server(_config(upstream))
    # The SDK hands gengate the error object or the whole body: KEY starts at 985 or 995.
    upstream.server.fail_next(Fault(status=500, body=_echoing_body(MESSAGE_CUT - 15)))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = g.GenerateRequest(model="remote", prompt="hi")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            if rpc == "Generate":
                await stub.Generate(request, timeout=10)
            else:
                async for _ in stub.GenerateStream(g.GenerateStreamRequest(request=request), timeout=10):
                    pass
    error = caught.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "x" * 100 in (error.details() or "")  # the upstream's text did come through, cut
    status = rpc_status.from_call(error)
    assert status is not None
    assert upstream.server.requests, "the upstream was called"
    assert leaked(KEY, error.details() or "", str(error), status.SerializeToString(), caplog.text) == []
    assert all(not leaked(KEY, r.getMessage()) for r in caplog.records)


async def test_log_records_are_redacted_and_bounded(
    make_server: Any,
    upstream: KeyedFakeOpenAI,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("GENGATE_TEST_TOKENS", TOKEN)
    await make_server(_config(upstream, auth_tokens_env="GENGATE_TEST_TOKENS"))
    log = logging.getLogger("gengate.test")
    log.warning("upstream said %s to caller %s", KEY, TOKEN)
    record = caplog.records[-1]
    assert record.getMessage() == "upstream said [REDACTED] to caller [REDACTED]"
    try:
        raise RuntimeError(f"failed with key {KEY}")
    except RuntimeError:
        log.exception("unexpected")
    assert not leaked(KEY, caplog.text) and not leaked(TOKEN, caplog.text)

    log.warning("huge: %s", "y" * 10_000_000)
    message = caplog.records[-1].getMessage()
    assert len(message) < MAX_LOG_MESSAGE + 40
    assert message.endswith(f"... [{len('huge: ') + 10_000_000 - MAX_LOG_MESSAGE} more characters]")
    assert len(caplog.text) < 100_000


def test_spans_are_redacted_before_export() -> None:
    register_secret(KEY)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(RedactingSpanProcessor(SimpleSpanProcessor(exporter)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("rpc", record_exception=False, set_status_on_exception=False) as span:
        span.set_attribute("upstream.body", f"echo {KEY}")
        span.set_attribute("upstream.list", [KEY, "fine"])
        span.record_exception(RuntimeError(f"key {KEY} rejected"))
        span.set_status(Status(StatusCode.ERROR, f"UNAVAILABLE: key {KEY}"))
    (finished,) = exporter.get_finished_spans()
    assert finished.status.status_code is StatusCode.ERROR
    texts = [str(v) for v in (finished.attributes or {}).values()]
    texts += [str(v) for e in finished.events for v in (e.attributes or {}).values()]
    texts.append(finished.status.description or "")
    assert leaked(KEY, *texts) == []
    assert finished.attributes is not None and finished.attributes["upstream.body"] == "echo [REDACTED]"
    provider.shutdown()


async def test_list_models_carries_no_key(make_server: Any, upstream: KeyedFakeOpenAI) -> None:
    """ListModels names models, kinds, capabilities and option keys, never a configured value."""
    config = _config(upstream)
    config["models"][0]["extra_headers"] = {"x-api-key": TOKEN}
    server = await make_server(config)
    async with grpc.aio.insecure_channel(server.address) as channel:
        answer = await generation_pb2_grpc.GenerationServiceStub(channel).ListModels(g.ListModelsRequest())
    assert [m.name for m in answer.models] == ["remote"]
    wire = answer.SerializeToString()
    assert leaked(KEY, wire) == [] and leaked(TOKEN, wire) == []
