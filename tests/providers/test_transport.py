"""providers.transport: the httpx and httpx2 clients the cohere, mistralai, google-genai and
huggingface_hub backends send on, over aiohttp (httpx's own transport where a proxy is set);
against real loopback servers: what each backend sends on, cookies kept by httpx alone, TLS
verified against httpx's CA bundle (SSL_CERT_FILE), and no connection cap unless one is given."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import contract_checks as cc
import httpx
import httpx2
import pki
import pytest
from aiohttp import web
from fake_cohere import API_KEY as COHERE_KEY
from fake_cohere import FakeCohere
from fake_gemini import API_KEY as GEMINI_KEY
from fake_gemini import FakeGemini
from fake_mistral import API_KEY as MISTRAL_KEY
from fake_mistral import FakeMistral
from fake_tgi import API_KEY as TGI_KEY
from fake_tgi import FakeTGI
from gengate import errors
from gengate.providers import stainless, transport
from gengate.providers.cohere import CohereBackend
from gengate.providers.gemini import GeminiBackend
from gengate.providers.mistral import MistralBackend
from gengate.providers.tgi import TGIBackend

PROXIES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXIES:
        monkeypatch.delenv(name, raising=False)


# --- the clients ---------------------------------------------------------------------------------


async def test_clients_send_on_aiohttp_unless_a_proxy_is_set() -> None:
    for client in (transport.httpx_client(), transport.httpx2_client()):
        assert transport.on_aiohttp(client)
        await client.aclose()
    for name in PROXIES:
        environ = {name: "http://proxy.internal:3128"}
        assert transport.proxy_in_environment(environ)
        for client in (transport.httpx_client(environ=environ), transport.httpx2_client(environ=environ)):
            assert not transport.on_aiohttp(client)
            await client.aclose()
    assert not transport.proxy_in_environment({"NO_PROXY": "*", "HTTP_PROXY": ""})


async def test_a_subclass_and_its_arguments_are_kept() -> None:
    class Mine(httpx.AsyncClient):
        pass

    client = transport.httpx_client(Mine, timeout=3.0, follow_redirects=True)
    assert isinstance(client, Mine) and transport.on_aiohttp(client)
    assert client.timeout == httpx.Timeout(3.0) and client.follow_redirects
    await client.aclose()
    proxied = transport.httpx_client(Mine, environ={"HTTPS_PROXY": "http://p:1"}, timeout=3.0)
    assert isinstance(proxied, Mine) and proxied.timeout == httpx.Timeout(3.0)
    await proxied.aclose()


@pytest.fixture
async def cookie_server() -> AsyncIterator[tuple[str, list[str]]]:
    """A server that sets a cookie on /set and records the Cookie header of every request."""
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie", ""))
        response = web.Response(text="ok")
        if request.path == "/set":
            response.set_cookie("session", "s1")
        return response

    runner = web.AppRunner(web.Application())
    runner.app.router.add_route("*", "/{tail:.*}", answer)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def _clients() -> list[Any]:
    """Every client gengate builds for an SDK: httpx, httpx2, and the openai and anthropic SDKs'
    own aiohttp clients."""
    import anthropic
    import openai

    sdks = [stainless.aiohttp_client(sdk, 5, environ={}) for sdk in (openai, anthropic)]
    return [transport.httpx_client(), transport.httpx2_client(), *sdks]


async def test_cookies_are_httpxs_alone(cookie_server: tuple[str, list[str]]) -> None:
    """httpx keeps a cookie and sends it once; aiohttp keeps none of its own, so a client told to
    forget its cookies sends none."""
    url, seen = cookie_server
    for client in _clients():
        seen.clear()
        async with client:
            await client.get(f"{url}/set")
            await client.get(f"{url}/next")
            assert client.cookies.get("session") == "s1"
            client.cookies.clear()
            await client.get(f"{url}/after")
        assert seen == ["", "session=s1", ""]


def _recording(jar: Any) -> list[str]:
    """The URLs of the requests whose responses `jar` (urllib's CookieJar) is handed from now."""
    read: list[str] = []
    extract = jar.extract_cookies

    def recorded(response: Any, request: Any) -> None:
        read.append(request.full_url)
        extract(response, request)

    jar.extract_cookies = recorded
    return read


async def test_the_jar_reads_only_responses_that_set_cookies(cookie_server: tuple[str, list[str]]) -> None:
    url, _ = cookie_server
    for client in _clients():
        read = _recording(client.cookies.jar)
        async with client:
            await client.get(f"{url}/none")
            assert read == []
            await client.get(f"{url}/set")
            assert read == [f"{url}/set"] and client.cookies.get("session") == "s1"
        assert type(client.cookies).__name__ == "CookiesReadWhenSet"


async def test_connection_caps_are_httpxs_unless_the_limits_give_one(
    cookie_server: tuple[str, list[str]],
) -> None:
    """httpx's default cap (100) unless the limits give one; no cap where they give None."""
    url, _ = cookie_server
    for limits, cap in (
        (None, 100),
        (httpx.Limits(max_connections=None), 0),
        (httpx.Limits(max_connections=7), 7),
    ):
        async with transport.httpx_client(limits=limits) as client:
            await client.get(url)
            session = client._transport.client  # type: ignore[attr-defined]
            assert session.connector.limit == cap
            assert session.connector._keepalive_timeout == (limits or httpx.Limits()).keepalive_expiry
    async with transport.httpx2_client(limits=httpx2.Limits(max_connections=None)) as client:
        await client.get(url)
        assert client._transport.client.connector.limit == 0
    proxied = transport.httpx_client(environ={"HTTPS_PROXY": "http://p:1"})
    assert proxied._transport._pool._max_connections == 100  # type: ignore[attr-defined]
    await proxied.aclose()


async def test_settings_only_httpxs_transport_takes_keep_it() -> None:
    """A client given a setting httpx hands to the transport it builds keeps that transport,
    so that the setting holds (aiohttp's would drop it)."""
    for settings in ({"verify": False}, {"trust_env": False}, {"http1": True}):
        for client in (transport.httpx_client(**settings), transport.httpx2_client(**settings)):
            assert not transport.on_aiohttp(client), settings
            await client.aclose()


async def test_an_upstream_that_stops_reading_the_body_is_a_write_timeout() -> None:
    """aiohttp has no write timeout: the wait for the answer is bounded by the request's four
    timeouts together, as httpx's WriteTimeout (DEADLINE_EXCEEDED)."""
    stalled: list[asyncio.StreamWriter] = []

    async def read_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stalled.append(writer)  # holds the connection open, reads nothing

    server = await asyncio.start_server(read_nothing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    body = b"x" * (64 * 1024 * 1024)  # more than the socket buffers hold
    try:
        for client, flavour in ((transport.httpx_client(), httpx), (transport.httpx2_client(), httpx2)):
            async with client:
                # aiohttp itself raises no WriteTimeout: only the bound can (without it, the
                # call waits for ever and the test's own timeout fails it).
                with pytest.raises(flavour.WriteTimeout) as info:
                    await client.post(f"http://127.0.0.1:{port}/", content=body, timeout=0.25)
                assert isinstance(errors_of(info.value), errors.DeadlineExceeded)
    finally:
        for writer in stalled:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    folder = tmp_path_factory.mktemp("tls")
    ca = pki.issue("test CA", None, ca=True)
    files = pki.write_server_files(folder, ca)
    yield Path(files["tls_cert_file"]), Path(files["tls_key_file"]), Path(files["tls_client_ca_file"])


async def test_tls_is_verified_against_httpxs_ca_bundle(
    tls_files: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An HTTPS upstream whose CA is in SSL_CERT_FILE is reached; without it the certificate is
    refused, and the error maps as unreachable."""
    cert, key, ca = tls_files
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    runner = web.AppRunner(web.Application())
    runner.app.router.add_get("/", _secure)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    url = f"https://localhost:{runner.addresses[0][1]}/"
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        async with transport.httpx_client() as client:
            assert (await client.get(url)).text == "secure"
        async with transport.httpx2_client() as client2:
            assert (await client2.get(url)).text == "secure"
        monkeypatch.delenv("SSL_CERT_FILE")
        async with transport.httpx_client() as client:
            with pytest.raises(httpx.HTTPError) as info:
                await client.get(url)
        assert "certificate" in repr(info.value.__cause__).lower()
        mapped = errors_of(info.value)
        assert isinstance(mapped, errors.Unavailable)
    finally:
        await runner.cleanup()


async def _secure(request: web.Request) -> web.Response:
    return web.Response(text="secure")


def errors_of(exc: BaseException) -> errors.GengateError:
    from gengate.providers.errors import normalize_exception

    return normalize_exception(exc, provider="upstream")


# --- the backends ----------------------------------------------------------------------------------


async def _own_client(fake: Any, build: cc.Make) -> Any:
    """The httpx client a backend builds for its SDK (`_http`)."""
    return (await build())._http


async def _hub_session(fake: Any, build: cc.Make) -> Any:
    """huggingface_hub's HTTP session, as the SDK asks for it."""
    backend: Any = await build()
    return await backend.client._get_async_client()


async def _started(backend: Any) -> Any:
    return backend


BACKENDS = {
    "cohere": (CohereBackend, FakeCohere, COHERE_KEY, _own_client),
    "mistral": (MistralBackend, FakeMistral, MISTRAL_KEY, _own_client),
    "gemini": (GeminiBackend, FakeGemini, GEMINI_KEY, _own_client),
    "tgi": (TGIBackend, FakeTGI, TGI_KEY, _hub_session),
}


@pytest.mark.parametrize("name", list(BACKENDS))
async def test_each_backend_sends_on_aiohttp_unless_a_proxy_is_set(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls, fake_cls, key, client_of = BACKENDS[name]
    fake = fake_cls()
    fake.start()
    try:
        async with cc.backends(
            cls, name, fake, model=f"{name}-test", base_url=fake.server.base_url, api_key=key
        ) as build:
            client = await client_of(fake, build)
            assert transport.on_aiohttp(client), type(client._transport)
            fake.answers.append("over aiohttp")
            backend = await build()
            assert (await backend.generate(cc.prompt())).generations[0].text == "over aiohttp"
            used = await client_of(fake, lambda: _started(backend))
            assert isinstance(used._transport.client, aiohttp.ClientSession)  # made by the call
            monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
            assert not transport.on_aiohttp(await client_of(fake, build))
    finally:
        fake.stop()
