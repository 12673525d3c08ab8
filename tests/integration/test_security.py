"""TLS, mutual TLS and bearer-token authentication of callers, and the default request timeout."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
from gengate.api.auth import CallerInterceptor
from gengate.callers.identity import CallerDirectory
from gengate.errors import ConfigError
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from observe import reason
from pki import issue, key_pem, pem

SCRIPTED = [{"name": "echo", "backend": "scripted"}]
TOKEN = "gg-test-token-7f3a9c"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("pki")
    ca = issue("gengate test CA", None, ca=True)
    server = issue("localhost", ca)
    client = issue("client", ca)
    files = {
        "ca": pem(ca[0]),
        "server_cert": pem(server[0]),
        "server_key": key_pem(server[1]),
        "client_cert": pem(client[0]),
        "client_key": key_pem(client[1]),
    }
    paths = {}
    for name, data in files.items():
        (folder / f"{name}.pem").write_bytes(data)
        paths[name] = str(folder / f"{name}.pem")
    return {"bytes": files, "paths": paths}


def _override_localhost() -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", "localhost")]


async def _echo(channel: grpc.aio.Channel, **kw: Any) -> g.GenerateResponse:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    reply: g.GenerateResponse = await stub.Generate(g.GenerateRequest(model="echo", prompt="hello"), **kw)
    return reply


async def test_tls_serves_trusted_clients_only(make_server: Any, pki: dict[str, Any]) -> None:
    paths = pki["paths"]
    server = await make_server(
        {
            "models": SCRIPTED,
            "server": {"tls_cert_file": paths["server_cert"], "tls_key_file": paths["server_key"]},
        }
    )
    trusted = grpc.ssl_channel_credentials(root_certificates=pki["bytes"]["ca"])
    async with grpc.aio.secure_channel(server.address, trusted, options=_override_localhost()) as channel:
        assert (await _echo(channel)).generations[0].text == "hello"
    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _echo(channel, timeout=2)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_requires_a_client_certificate(make_server: Any, pki: dict[str, Any]) -> None:
    paths, data = pki["paths"], pki["bytes"]
    server = await make_server(
        {
            "models": SCRIPTED,
            "server": {
                "tls_cert_file": paths["server_cert"],
                "tls_key_file": paths["server_key"],
                "tls_client_ca_file": paths["ca"],
            },
        }
    )
    with_cert = grpc.ssl_channel_credentials(data["ca"], data["client_key"], data["client_cert"])
    async with grpc.aio.secure_channel(server.address, with_cert, options=_override_localhost()) as channel:
        assert (await _echo(channel)).generations[0].text == "hello"
    without = grpc.ssl_channel_credentials(root_certificates=data["ca"])
    async with grpc.aio.secure_channel(server.address, without, options=_override_localhost()) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _echo(channel, timeout=2)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_bearer_tokens_guard_every_rpc_but_health(
    make_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("GENGATE_TEST_TOKENS", f"other-token, {TOKEN}")
    server = await make_server({"models": SCRIPTED, "server": {"auth_tokens_env": "GENGATE_TEST_TOKENS"}})
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _echo(channel)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert reason(caught.value) == "MISSING_CREDENTIALS"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _echo(channel, metadata=(("authorization", "Bearer wrong"),))
        assert reason(caught.value) == "INVALID_CREDENTIALS"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.GenerateStream(
                g.GenerateStreamRequest(request=g.GenerateRequest(model="echo"))
            ):
                pass
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ListModels(g.ListModelsRequest())
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = await _echo(channel, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert ok.generations[0].text == "hello"
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert TOKEN not in caplog.text and "wrong" not in caplog.text


async def test_empty_token_variable_fails_start(make_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENGATE_TEST_TOKENS", " , ")
    with pytest.raises(ConfigError, match="holds no token"):
        await make_server({"models": SCRIPTED, "server": {"auth_tokens_env": "GENGATE_TEST_TOKENS"}})


async def test_missing_certificate_file_fails_start(make_server: Any, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tls_cert_file: cannot read"):
        await make_server(
            {
                "models": SCRIPTED,
                "server": {
                    "tls_cert_file": str(tmp_path / "absent.pem"),
                    "tls_key_file": str(tmp_path / "absent.key"),
                },
            }
        )


async def test_default_request_timeout_applies_to_calls_without_a_deadline(make_server: Any) -> None:
    slow = {"name": "echo", "backend": "scripted", "text": "a b c d e f", "tokens_per_s": 2}
    server = await make_server({"models": [slow], "server": {"request_timeout_s": 0.3}})
    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _echo(channel)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_max_connection_age_closes_idle_connections_so_clients_rebalance(make_server: Any) -> None:
    server = await make_server({"models": SCRIPTED, "server": {"max_connection_age_s": 0.3}})
    async with grpc.aio.insecure_channel(server.address) as channel:
        assert (await _echo(channel)).generations[0].text == "hello"
        # the server sends GOAWAY after the age; the channel leaves READY and reconnects on the next call
        import asyncio

        state = channel.get_state()
        for _ in range(60):
            await asyncio.sleep(0.1)
            state = channel.get_state()
            if state != grpc.ChannelConnectivity.READY:
                break
        assert state != grpc.ChannelConnectivity.READY
        assert (await _echo(channel)).generations[0].text == "hello"


async def _auth_server(make_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("GENGATE_TEST_TOKENS", TOKEN)
    return await make_server({"models": SCRIPTED, "server": {"auth_tokens_env": "GENGATE_TEST_TOKENS"}})


async def _health(channel: grpc.aio.Channel, service: str, **kw: Any) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), **kw
    )
    status: int = reply.status
    return status


async def test_model_health_needs_a_token_but_overall_health_stays_open(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await _auth_server(make_server, monkeypatch)
    serving = health_pb2.HealthCheckResponse.SERVING
    with_token = {"metadata": (("authorization", f"Bearer {TOKEN}"),)}
    async with grpc.aio.insecure_channel(server.address) as channel:
        assert await _health(channel, "") == serving
        assert await _health(channel, "gengate.v1.GenerationService") == serving
        assert await _health(channel, "gengate.v1.GenerationService/echo", **with_token) == serving
        # Without a token a model's health, or whether a model exists at all, is not told.
        for name in ("gengate.v1.GenerationService/echo", "gengate.v1.GenerationService/ghost"):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _health(channel, name)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert reason(caught.value) == "MISSING_CREDENTIALS"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _health(
                channel, "gengate.v1.GenerationService/echo", metadata=(("authorization", "Bearer no"),)
            )
        assert reason(caught.value) == "INVALID_CREDENTIALS"

        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="gengate.v1.GenerationService/echo")
        watch = stub.Watch(request, timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await watch.read()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        watch = stub.Watch(request, timeout=5, **with_token)
        assert (await watch.read()).status == serving
        watch.cancel()
        overall = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert (await overall.read()).status == serving
        overall.cancel()


async def test_rejected_call_body_is_never_parsed(make_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server = await _auth_server(make_server, monkeypatch)
    garbage = b"\xff\xff\xff\xff not a protobuf message"
    async with grpc.aio.insecure_channel(server.address) as channel:
        # No serializers: the bytes go on the wire exactly as given.
        generate: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/gengate.v1.GenerationService/Generate"
        )
        stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
            "/gengate.v1.GenerationService/GenerateStream"
        )
        for call in (generate(garbage, timeout=5), stream(garbage, timeout=5).read()):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert reason(caught.value) == "MISSING_CREDENTIALS"
        # The same bytes with a valid token do reach the parser, and fail there: they are garbage.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate(garbage, timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert caught.value.code() != grpc.StatusCode.UNAUTHENTICATED


async def test_interceptor_never_deserializes_a_rejected_call() -> None:
    """On a bare server with a service of its own: the rejected call's deserializer never runs."""
    parsed: list[bytes] = []

    def parse(data: bytes) -> bytes:
        parsed.append(data)
        return data

    async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    handler = grpc.unary_unary_rpc_method_handler(echo, request_deserializer=parse, response_serializer=bytes)
    directory = CallerDirectory.from_config((), legacy_tokens_env="TOKENS", env={"TOKENS": TOKEN})
    server = grpc.aio.server(interceptors=[CallerInterceptor(directory)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Call": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/test.Echo/Call")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(b"unauthenticated bytes", timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED and parsed == []
            metadata = (("authorization", f"Bearer {TOKEN}"),)
            assert await call(b"hello", timeout=5, metadata=metadata) == b"hello"
            assert parsed == [b"hello"]
    finally:
        await server.stop(0)
