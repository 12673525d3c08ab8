"""providers.stainless: the OpenAI family's and Anthropic's requests are copies of one their SDK
built. First the SDK internals a copy relies on, by name (an SDK upgrade that moves one fails
here, saying which); then, against the fake upstreams, a copy and the SDK's own `post` send the
same request (path, query, headers, body), raise the same errors for a status, a timeout and a
refused connection, and a client whose auth is computed per request goes the SDK's whole way."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import contract_checks as cc
import openai
import pytest
from fake_anthropic import API_KEY as ANTHROPIC_KEY
from fake_anthropic import FakeAnthropic
from fake_openai import API_KEY as OPENAI_KEY
from fake_openai import FakeOpenAI
from fakehttp import FakeServer, Fault, Recorded
from gengate import errors as gengate_errors
from gengate.providers import rawhttp, stainless
from gengate.providers.errors import UnreadableAnswer, normalize_exception


@dataclass
class Case:
    """One SDK's client against its fake: the route, a body, the options a backend passes."""

    package: str
    server: FakeServer
    client: Any
    path: str
    body: dict[str, Any]
    options: dict[str, Any]
    make: Callable[[str], Any]  # a client of this SDK for another base URL

    def posts(self) -> stainless.PreparedPosts:
        return stainless.PreparedPosts(self.client, self.package)


OPENAI_BODY = {"model": "gpt-test", "messages": [{"role": "user", "content": "héllo"}], "max_tokens": 8}
ANTHROPIC_BODY = {"model": "claude-test", "messages": [{"role": "user", "content": "héllo"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def openai_fake() -> Iterator[FakeOpenAI]:
    yield from cc.serving(FakeOpenAI())


@pytest.fixture(scope="module")
def anthropic_fake() -> Iterator[FakeAnthropic]:
    yield from cc.serving(FakeAnthropic())


def _openai(base: str, http: Any = None) -> Any:
    return openai.AsyncOpenAI(
        api_key=OPENAI_KEY, base_url=f"{base}/v1", max_retries=0, timeout=30, http_client=http
    )


def _azure(base: str, http: Any = None) -> Any:
    return openai.AsyncAzureOpenAI(
        api_key=OPENAI_KEY,
        azure_endpoint=base,
        azure_deployment="gpt-test",
        api_version="2024-10-21",
        max_retries=0,
        http_client=http,
    )


def _anthropic(base: str, http: Any = None) -> Any:
    return anthropic.AsyncAnthropic(
        api_key=ANTHROPIC_KEY, base_url=base, max_retries=0, timeout=30, http_client=http
    )


def _on(make: Callable[[str, Any], Any], sdk: Any, transport: str) -> Callable[[str], Any]:
    """`make` on the SDK's default httpx2 client, or on its aiohttp client (what backends use)."""
    if transport == "httpx2":
        return lambda base: make(base, None)
    return lambda base: make(base, stainless.aiohttp_client(sdk, 30, environ={}))


@pytest.fixture(params=["httpx2", "aiohttp"])
def transport(request: Any) -> str:
    return str(request.param)


@pytest.fixture(params=["openai", "azure", "anthropic"])
async def case(
    request: Any,
    transport: str,
    openai_fake: FakeOpenAI,
    anthropic_fake: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Case]:
    # Another test in this process may have installed a tracer provider, which sends anthropic's
    # calls its own whole way: these cases are about copies (the tracing case sets it itself).
    monkeypatch.setattr(stainless, "tracing_enabled", lambda: False)
    if request.param == "anthropic":
        anthropic_fake.reset()
        server, path, body = anthropic_fake.server, "/v1/messages", ANTHROPIC_BODY
        make = _on(_anthropic, anthropic, transport)
        options: dict[str, Any] = {"timeout": 7.5, "headers": {"x-trace": "abc"}}
    else:
        openai_fake.reset()
        make = _on(_openai if request.param == "openai" else _azure, openai, transport)
        server, path, body = openai_fake.server, "/chat/completions", OPENAI_BODY
        options = {"security": {"bearer_auth": True}, "timeout": 7.5, "headers": {"x-trace": "abc"}}
    client = make(server.base_url)
    package = "anthropic" if request.param == "anthropic" else "openai"
    yield Case(package, server, client, path, body, options, make)
    await client.close()


# --- the SDK internals, by name -------------------------------------------------------------------


_has = cc.sdk_hook


async def test_the_sdk_internals_a_copy_relies_on_are_there() -> None:
    from openai import _httpx2

    clients = [_openai("http://127.0.0.1:9"), _azure("http://127.0.0.1:9"), _anthropic("http://127.0.0.1:9")]
    try:
        for cls in (openai.AsyncOpenAI, anthropic.AsyncAnthropic):
            _has(cls, "_prepare_options", "options")
            _has(cls, "_build_request", "options", "retries_taken")
            _has(cls, "_prepare_request", "request")
            _has(cls, "_make_status_error_from_response", "response")
        for client in clients:
            for name in ("_client", "_platform", "custom_auth"):
                _has(client, name)
            assert not stainless.per_request_auth(client)
        for package in ("openai", "anthropic"):
            sdk = stainless.Sdk.of(package)
            _has(sdk.final_request_options, "construct")
            for field in ("method", "url", "json_data"):
                assert field in sdk.final_request_options.model_fields, (
                    f"{package} FinalRequestOptions.{field}"
                )
        assert "security" in openai._models.FinalRequestOptions.model_fields
        for name in ("timeout_exceptions", "request_exceptions"):
            _has(_httpx2, name)
        # Every attribute that marks auth computed per request is still spelled so: a renamed one
        # would read as "not set", and a copy would carry a stale credential.
        for name in stainless.PER_REQUEST_AUTH:
            assert any(hasattr(c, name) for c in clients), f"no SDK client has `{name}` any more"
    finally:
        for client in clients:
            await client.close()


# --- a copy is the SDK's own request ---------------------------------------------------------------


def _sent(rec: Recorded) -> tuple[str, str, dict[str, str], dict[str, str], Any]:
    headers = {k: v for k, v in rec.headers.items() if k != "content-length"}
    return rec.method, rec.path, rec.query, headers, rec.body


async def test_a_copy_sends_what_the_sdk_sends(case: Case) -> None:
    """The SDK's own post, then a prepared copy twice (built, then reused): the same request."""
    posts = case.posts()
    assert posts.prepared
    for send in (
        rawhttp.post(case.client, case.path, case.body, case.options),
        posts.post(case.path, case.body, case.options),
        posts.post(case.path, case.body, case.options),
    ):
        assert await rawhttp.read_object(await send)
    own, copy, again = (_sent(r) for r in case.server.requests[-3:])
    assert copy == own and again == own
    headers = copy[3]
    assert headers["x-trace"] == "abc" and headers["x-stainless-read-timeout"] == "7.5"
    assert copy[4] == case.body
    if case.package == "anthropic":
        assert ANTHROPIC_KEY in (headers.get("x-api-key"), headers.get("authorization", "")[7:])
        assert "anthropic-version" in headers
    elif "api-key" in headers:  # Azure: the deployment's route, the version, its key header
        assert copy[1:3] == ("/openai/deployments/gpt-test/chat/completions", {"api-version": "2024-10-21"})
    else:
        assert headers["authorization"] == f"Bearer {OPENAI_KEY}"


async def test_each_call_keeps_its_own_timeout_and_headers(case: Case) -> None:
    posts = case.posts()
    await (await posts.post(case.path, case.body, case.options)).aclose()
    plain = {k: v for k, v in case.options.items() if k == "security"}
    await (await posts.post(case.path, case.body, plain)).aclose()
    await (await rawhttp.post(case.client, case.path, case.body, plain)).aclose()
    first, second, own = case.server.requests[-3:]
    assert first.headers["x-stainless-read-timeout"] == "7.5" and first.headers["x-trace"] == "abc"
    assert "x-trace" not in second.headers and _sent(second) == _sent(own)  # the client's own timeout


async def test_a_copy_carries_its_own_body_and_the_template_none(case: Case) -> None:
    """A template is built for a body of the model alone: a later call's body is its own, and no
    caller's prompt stays behind in the template."""
    posts = case.posts()
    other = {**case.body, "messages": [{"role": "user", "content": "a second, different prompt"}]}
    for body in (case.body, other):
        assert await rawhttp.read_object(await posts.post(case.path, body, case.options))
    first, second = case.server.requests[-2:]
    assert json.loads(first.raw) == case.body and json.loads(second.raw) == other
    (template,) = posts._templates.values()
    assert b"prompt" not in template.content and "héllo".encode() not in template.content


async def test_a_copy_sends_the_clients_cookies_as_they_are_now(case: Case) -> None:
    """httpx writes the jar's cookies into each request it builds (a load balancer's sticky
    session, Cloudflare's __cf_bm): a copy sends the jar as it is when it is sent, as the SDK's
    own request does, never the template's."""
    posts = case.posts()
    sent = []
    for value in ("one", "two"):
        case.client._client.cookies.set("sticky", value)
        for send in (
            rawhttp.post(case.client, case.path, case.body, case.options),
            posts.post(case.path, case.body, case.options),
        ):
            await (await send).aclose()
        own, copy = case.server.requests[-2:]
        sent.append((own.headers.get("cookie"), copy.headers.get("cookie")))
    assert sent == [("sticky=one", "sticky=one"), ("sticky=two", "sticky=two")]


async def test_a_subclass_or_anthropic_while_tracing_goes_the_sdks_way(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client subclass may sign or change each request (Bedrock, Vertex); anthropic traces
    each call itself while a tracer provider is installed: neither is copied."""
    subclass = type("Signing", (type(case.client),), {})
    assert not stainless.preparable(object.__new__(subclass), case.package)
    monkeypatch.setattr(stainless, "tracing_enabled", lambda: True)
    posts = case.posts()
    assert await rawhttp.read_object(await posts.post(case.path, case.body, case.options))
    assert bool(posts._templates) == (case.package == "openai")  # openai's SDK traces nothing


async def test_past_the_template_limit_a_call_goes_the_sdks_way(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stainless, "_MAX_TEMPLATES", 1)
    posts = case.posts()
    other = {**case.body, "model": "another-model"}
    for body in (case.body, other, other):
        assert await rawhttp.read_object(await posts.post(case.path, body, case.options))
    assert len(posts._templates) == 1
    sent = [r.body["model"] for r in case.server.requests[-3:]]
    assert sent == [case.body["model"], "another-model", "another-model"]


# --- the same errors -----------------------------------------------------------------------------


async def _error_of(send: Any) -> BaseException:
    try:
        response = await send
    except Exception as exc:
        return exc
    await response.aclose()
    raise AssertionError("no error raised")


@pytest.mark.parametrize(("status", "named"), [(429, "RateLimitError"), (302, "APIStatusError")])
async def test_a_status_error_is_the_sdks_own(case: Case, status: int, named: str) -> None:
    """Any answer but 2xx is the SDK's status error: a 429, and a 302 without a Location (not
    followed, and no answer either)."""
    body = {"error": {"message": "slow down", "type": "rate_limit_error"}}
    posts = case.posts()
    errors = []
    for send in (
        lambda: rawhttp.post(case.client, case.path, case.body, case.options),
        lambda: posts.post(case.path, case.body, case.options),
    ):
        case.server.fail_next(Fault(status=status, body=body, headers={"retry-after": "3"}))
        errors.append(await _error_of(send()))
    own, copy = errors
    assert type(copy) is type(own) and type(own).__name__ == named
    assert (copy.status_code, copy.body, copy.message) == (own.status_code, own.body, own.message)  # type: ignore[attr-defined]
    assert copy.response.headers["retry-after"] == "3"  # type: ignore[attr-defined]


async def test_an_error_body_over_the_limit_is_unreadable(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK read an error body whole, however long; a copy's is read bounded."""
    monkeypatch.setattr(rawhttp, "ERROR_BODY_BYTES", 1000)
    case.server.fail_next(Fault(status=500, body={"error": {"message": "x" * 5000}}))
    error = await _error_of(case.posts().post(case.path, case.body, case.options))
    assert isinstance(error, UnreadableAnswer) and "over gengate's limit of 1000" in str(error)


async def test_timeouts_and_refused_connections_are_the_sdks_errors(case: Case) -> None:
    sdk = stainless.Sdk.of(case.package)
    case.server.fail_next(Fault(delay_s=2.0))
    timed_out = await _error_of(case.posts().post(case.path, case.body, {**case.options, "timeout": 0.2}))
    assert type(timed_out) is sdk.timeout_error
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    closed = case.make(f"http://127.0.0.1:{port}")
    try:
        errors = [
            await _error_of(rawhttp.post(closed, case.path, case.body, case.options)),
            await _error_of(
                stainless.PreparedPosts(closed, case.package).post(case.path, case.body, case.options)
            ),
        ]
    finally:
        await closed.close()
    # A copy raises what the SDK raises (aiohttp's transport calls a refusal a ConnectTimeout, so
    # there the SDK's word is its timeout error); gengate reads both as unreachable.
    assert type(errors[1]) is type(errors[0])
    assert type(errors[0]) in (sdk.connection_error, sdk.timeout_error)
    assert all(isinstance(normalize_exception(e), gengate_errors.Unavailable) for e in errors)


# --- auth computed per request ---------------------------------------------------------------------


async def test_a_client_whose_auth_is_computed_per_request_goes_the_sdks_way(openai_fake: FakeOpenAI) -> None:
    openai_fake.reset()
    asked = []

    async def key() -> str:
        asked.append(1)
        return OPENAI_KEY

    options = {"security": {"bearer_auth": True}}
    async with openai.AsyncOpenAI(
        api_key=key, base_url=f"{openai_fake.server.base_url}/v1", max_retries=0
    ) as sdk:
        posts = stainless.PreparedPosts(sdk, "openai")
        assert stainless.per_request_auth(sdk) and not posts.prepared
        for _ in range(2):
            await rawhttp.read_object(await posts.post("/chat/completions", OPENAI_BODY, options))
    assert len(asked) == 2  # the key asked for each request, as the SDK does
    assert [json.loads(r.raw) for r in openai_fake.server.requests] == [OPENAI_BODY, OPENAI_BODY]


# --- the transport ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sdk", [openai, anthropic], ids=["openai", "anthropic"])
async def test_backends_use_the_sdks_aiohttp_client_unless_a_proxy_is_set(sdk: Any) -> None:
    """The SDK's DefaultAioHttpClient as the SDK builds it, on the httpx-aiohttp transport it
    vendors (which drops HTTP(S)_PROXY: then httpx2 stays) and gengate's session."""
    import importlib

    vendored = importlib.import_module(f"{sdk.__name__}._vendor.httpx_aiohttp").AiohttpTransport
    limits = importlib.import_module(f"{sdk.__name__}._constants").DEFAULT_CONNECTION_LIMITS
    client = stainless.aiohttp_client(sdk, 5, environ={})
    assert client is not None and isinstance(client._transport, vendored)
    assert client._transport.limits == limits and client.follow_redirects
    assert client.timeout == type(client.timeout)(5)
    await client.aclose()
    for name in ("HTTPS_PROXY", "http_proxy", "ALL_PROXY"):
        assert stainless.aiohttp_client(sdk, 5, environ={name: "http://proxy.internal:3128"}) is None


async def test_an_openai_backend_sends_on_the_aiohttp_client(
    openai_fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gengate.providers.openai import OpenAIBackend

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    backend = OpenAIBackend(
        "o",
        OpenAIBackend.Options(
            model="gpt-test", base_url=f"{openai_fake.server.base_url}/v1", api_key=OPENAI_KEY
        ),
    )
    await backend.start()
    try:
        assert type(backend._client._client._transport).__name__ == "AiohttpTransport"
        openai_fake.reset()
        assert (await backend.generate(cc.prompt())).generations[0].text
    finally:
        await backend.aclose()
