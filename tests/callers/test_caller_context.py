"""The caller is current wherever the call runs: in the handler, in the core and the tasks it
starts (batch items), on the RPC span and the backend span, and on log lines. grpc.aio does not
promise that what an interceptor sets in its own coroutine reaches the handler, so the caller
is set inside the handler's context; these tests hold it there, with tracing's interceptor in
front as in production. Tokens never show: only names."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from gengate.api.auth import CallerInterceptor
from gengate.api.tracing import tracing_interceptor
from gengate.caller import current_caller, current_policy
from gengate.callers.config import CallerConfig
from gengate.callers.context import serving
from gengate.callers.identity import CallerDirectory
from gengate.config import parse_config
from gengate.errors import Unauthenticated
from gengate.logs import RequestContext
from gengate_client import AsyncClient
from gengate_client.errors import UnauthenticatedError, UnavailableError
from observe import ServerFactory
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from pki import LOCALHOST, issue, key_pem, pem, write_server_files
from teams import TOKEN_A, TOKEN_B, TOKENS, bearer, with_callers


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    """Every span of this process also goes here (one SDK provider per process, as in test_tracing)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory


def _directory() -> CallerDirectory:
    config = parse_config(
        {"models": [{"name": "m", "backend": "scripted"}], "callers": [{"name": "team-a", "token_env": "A"}]}
    )
    found = CallerDirectory.from_config(config.callers, env={"A": TOKEN_A})
    assert found is not None
    return found


async def test_the_caller_reaches_every_kind_of_handler_and_the_tasks_it_starts(
    exporter: InMemorySpanExporter,
) -> None:
    """A bare server with probe methods answering current_caller(): unary, server stream (after
    awaits), client stream, and a task the handler starts."""

    async def unary(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(0)
        inner = await asyncio.create_task(_probe())
        return f"{current_caller()}|{inner}".encode()

    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for _ in range(3):
            await asyncio.sleep(0)
            yield current_caller().encode()

    async def upload(requests: AsyncIterator[bytes], context: Any) -> bytes:
        async for _ in requests:
            await asyncio.sleep(0)
        return current_caller().encode()

    async def _probe() -> str:
        await asyncio.sleep(0)
        return current_caller()

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
    }
    tracing = tracing_interceptor()
    assert tracing is not None, "tracing is installed by the exporter fixture"
    server = grpc.aio.server(interceptors=[tracing, CallerInterceptor(_directory())])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Probe", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            auth = {"metadata": bearer(TOKEN_A), "timeout": 10}
            unary_call: Any = channel.unary_unary("/test.Probe/Unary")
            stream_call: Any = channel.unary_stream("/test.Probe/Stream")
            upload_call: Any = channel.stream_unary("/test.Probe/Upload")
            assert await unary_call(b"x", **auth) == b"team-a|team-a"
            assert [m async for m in stream_call(b"x", **auth)] == [b"team-a"] * 3
            assert await upload_call(iter([b"a", b"b"]), **auth) == b"team-a"
            # the caller of one call never leaks into the next one's context
            assert current_caller() == "anonymous"
    finally:
        await server.stop(0)
    rpc_spans = [s for s in exporter.get_finished_spans() if s.name.startswith("/test.Probe/")]
    assert len(rpc_spans) == 3
    assert {s.attributes.get("gengate.caller") for s in rpc_spans if s.attributes} == {"team-a"}


async def test_spans_and_logs_of_a_call_carry_its_caller_never_its_token(
    exporter: InMemorySpanExporter, make_server: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    models = [
        {"name": "echo", "backend": "scripted"},
        {"name": "broken", "backend": "scripted", "text": "a b c", "fail_after_tokens": 1},
    ]
    callers = [
        {"name": "team-a", "token_env": "TEAM_A_TOKEN"},
        {"name": "team-b", "token_env": "TEAM_B_TOKEN"},
    ]
    server = await make_server(with_callers(models, callers))
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(RequestContext())  # what `gengate serve` puts on its handlers
    exporter.clear()
    async with AsyncClient(server.address, max_retries=0) as client:  # one span per call
        await client.generate("echo", "hello", metadata=bearer(TOKEN_A))
        [f async for f in client.generate_stream("echo", "hello", metadata=bearer(TOKEN_B))]
        await client.batch_generate([{"model": "echo", "prompt": "x"}] * 2, metadata=bearer(TOKEN_A))
        with pytest.raises(UnavailableError):  # logged (a warning) inside the call
            await client.generate("broken", "hello", metadata=bearer(TOKEN_B))
        with pytest.raises(UnauthenticatedError):
            await client.generate("echo", "hello", metadata=bearer("not-a-token-of-anyone"))
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind == SpanKind.SERVER and s.name.endswith("/Generate")]
    streams = [s for s in spans if s.kind == SpanKind.SERVER and s.name.endswith("GenerateStream")]
    batches = [s for s in spans if s.kind == SpanKind.SERVER and s.name.endswith("BatchGenerate")]
    assert [s.attributes.get("gengate.caller") for s in servers if s.attributes] == ["team-a", "team-b", None]
    assert [s.attributes.get("gengate.caller") for s in streams if s.attributes] == ["team-b"]
    assert [s.attributes.get("gengate.caller") for s in batches if s.attributes] == ["team-a"]
    # The backend spans are made in the core (router), batch items in tasks of their own.
    backends = [
        s.attributes.get("gengate.caller") for s in spans if s.kind == SpanKind.CLIENT and s.attributes
    ]
    assert sorted(backends) == ["team-a", "team-a", "team-a", "team-b", "team-b"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "SCRIPTED" in r.getMessage()]
    assert warnings and all(getattr(r, "caller", None) == "team-b" for r in warnings)
    everything = caplog.text + repr([s.to_json() for s in spans])
    for token in (*TOKENS.values(), "not-a-token-of-anyone"):
        assert token not in everything


async def test_mutual_tls_callers_are_known_by_their_certificate_subject(
    make_server: ServerFactory, tmp_path: Path
) -> None:
    ca = issue("gengate test CA", None, ca=True)
    server_files = write_server_files(tmp_path, ca)
    models = [{"name": "tiny", "backend": "scripted"}, {"name": "gpt", "backend": "scripted"}]
    callers = [
        {"name": "team-b", "subject": "CN=team-b, O=Acme\\, Inc", "models": ["gpt"]},
        {"name": "team-a", "token_env": "TEAM_A_TOKEN", "models": ["tiny"]},
    ]
    server = await make_server(with_callers(models, callers, **server_files))

    def credentials(name: str, organization: str | None) -> grpc.ChannelCredentials:
        cert, key = issue(name, ca, organization=organization)
        return grpc.ssl_channel_credentials(pem(ca[0]), key_pem(key), pem(cert))

    team_b = credentials("team-b", "Acme, Inc")
    async with AsyncClient(server.address, credentials=team_b, options=LOCALHOST) as client:
        assert [m.name for m in await client.list_models()] == ["gpt"]  # no token: the certificate names it
        assert (await client.generate("gpt", "hi")).generations
        # A token, when given, is the caller's name for itself (and a wrong one is refused).
        assert [m.name for m in await client.list_models(metadata=bearer(TOKEN_A))] == ["tiny"]
        with pytest.raises(UnauthenticatedError) as caught:
            await client.list_models(metadata=bearer("wrong-token-1234"))
        assert caught.value.reason == "INVALID_CREDENTIALS"
    stranger = credentials("team-x", "Acme, Inc")  # signed by the CA, but no caller's subject
    async with AsyncClient(server.address, credentials=stranger, options=LOCALHOST) as client:
        with pytest.raises(UnauthenticatedError) as caught:
            await client.generate("gpt", "hi")
        assert caught.value.reason == "MISSING_CREDENTIALS"
        assert "subject" in caught.value.message


async def test_every_intercepted_call_sets_its_caller_and_a_refused_one_none() -> None:
    """The interceptor makes the caller current itself (one set a call); a call whose token
    names nobody leaves none current, so no earlier call's caller could serve it."""
    interceptor = CallerInterceptor(_directory())
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)

    async def continuation(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        return handler

    known = SimpleNamespace(method="/gengate.v1.Gengate/Generate", invocation_metadata=bearer(TOKEN_A))
    await interceptor.intercept_service(continuation, known)  # type: ignore[arg-type]
    assert current_caller() == "team-a"
    wrong = SimpleNamespace(method="/gengate.v1.Gengate/Generate", invocation_metadata=bearer(TOKEN_B))
    await interceptor.intercept_service(continuation, wrong)  # type: ignore[arg-type]
    assert current_policy() is None and current_caller() == "anonymous"


async def test_with_certificate_callers_the_handler_identifies_every_call_itself() -> None:
    """Where a caller may be known by its certificate, the interceptor identifies nobody, and a
    caller already current around the handler (embedding code, a job's owner) never stands in
    for the call's own credentials."""
    callers = [CallerConfig(name="team-a", token_env="A"), CallerConfig(name="team-b", subject="CN=team-b")]
    directory = CallerDirectory.from_config(callers, env={"A": TOKEN_A})
    assert directory is not None and directory.by_certificate
    interceptor = CallerInterceptor(directory)
    bare_call = SimpleNamespace(invocation_metadata=lambda: (), auth_context=lambda: {})
    with serving(directory.by_name("team-a")):
        refusal = interceptor._refusal(bare_call)  # type: ignore[arg-type]
    assert isinstance(refusal, Unauthenticated) and refusal.reason == "MISSING_CREDENTIALS"
