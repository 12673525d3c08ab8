"""providers.openai_send: the OpenAI family's requests are copies of one the openai SDK built.
First the SDK internals the copy relies on, by name (an SDK upgrade that moves one fails here,
saying which); then, against the fake upstream, a copy and the SDK's own `post` send the same
request (path, query, headers, body), raise the same errors for a status, a timeout and a refused
connection, and a client whose auth is computed per request goes the SDK's whole way."""

from __future__ import annotations

import inspect
import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import contract_checks as cc
import openai
import pytest
from fake_openai import API_KEY, FakeOpenAI
from fakehttp import Fault, Recorded
from gengate.providers import openai_send, rawhttp
from gengate.providers.errors import UnreadableAnswer

BODY = {"model": "gpt-test", "messages": [{"role": "user", "content": "héllo"}], "max_tokens": 8}
OPTIONS = {"security": {"bearer_auth": True}, "timeout": 7.5, "headers": {"x-trace": "abc"}}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    yield from cc.serving(FakeOpenAI())


@pytest.fixture
async def client(fake: FakeOpenAI) -> AsyncIterator[Any]:
    fake.reset()
    sdk = openai.AsyncOpenAI(
        api_key=API_KEY, base_url=f"{fake.server.base_url}/v1", max_retries=0, timeout=30
    )
    yield sdk
    await sdk.close()


@pytest.fixture
async def azure(fake: FakeOpenAI) -> AsyncIterator[Any]:
    fake.reset()
    sdk = openai.AsyncAzureOpenAI(
        api_key=API_KEY,
        azure_endpoint=fake.server.base_url,
        azure_deployment="gpt-test",
        api_version="2024-10-21",
        max_retries=0,
    )
    yield sdk
    await sdk.close()


# --- the SDK internals, by name -------------------------------------------------------------------


def _has(owner: Any, name: str, *parameters: str) -> None:
    where = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
    assert hasattr(owner, name), f"{where} is gone: providers.openai_send relies on it"
    if parameters:
        taken = set(inspect.signature(getattr(owner, name)).parameters)
        missing = [p for p in parameters if p not in taken]
        assert not missing, f"{where} no longer takes {missing}: providers.openai_send passes them"


async def test_the_sdk_internals_a_copy_relies_on_are_there(client: Any, azure: Any) -> None:
    from openai import _base_client, _httpx2, _models

    for name, params in (
        ("_prepare_options", ("options",)),
        ("_build_request", ("options", "retries_taken")),
        ("_prepare_request", ("request",)),
        ("_make_status_error_from_response", ("response",)),
    ):
        _has(openai.AsyncOpenAI, name, *params)
    for name in ("_client", "_platform", "custom_auth"):
        _has(client, name)
    _has(_models.FinalRequestOptions, "construct")
    for field in ("method", "url", "json_data", "security"):
        assert field in _models.FinalRequestOptions.model_fields, f"FinalRequestOptions.{field} is gone"
    for module, name in (
        (_httpx2, "timeout_exceptions"),
        (_httpx2, "request_exceptions"),
        (_base_client, "get_platform"),
    ):
        _has(module, name)
    # Every attribute that marks auth computed per request is still spelled so: a renamed one
    # would read as "not set", and a copy would carry a stale credential.
    for name in openai_send._PER_REQUEST_AUTH:
        assert hasattr(client, name) or hasattr(azure, name), f"the openai SDK has no `{name}` any more"
    assert not openai_send.per_request_auth(client) and not openai_send.per_request_auth(azure)


# --- a copy is the SDK's own request ---------------------------------------------------------------


def _sent(rec: Recorded) -> tuple[str, str, dict[str, str], dict[str, str], Any]:
    headers = {k: v for k, v in rec.headers.items() if k != "content-length"}
    return rec.method, rec.path, rec.query, headers, rec.body


async def _post_both(fake: FakeOpenAI, sdk: Any, path: str) -> tuple[Any, Any]:
    """The request the SDK's own post sends, then a prepared copy's (twice: built, then reused)."""
    posts = openai_send.PreparedPosts(sdk)
    assert posts.prepared
    for send in (
        rawhttp.post(sdk, path, BODY, OPTIONS),
        posts.post(path, BODY, OPTIONS),
        posts.post(path, BODY, OPTIONS),
    ):
        answer = await rawhttp.read_object(await send)
        assert answer["choices"][0]["message"]["content"]
    own, copy, again = (_sent(r) for r in fake.server.requests[-3:])
    assert copy == again
    return own, copy


async def test_a_copy_sends_what_the_sdk_sends(fake: FakeOpenAI, client: Any) -> None:
    own, copy = await _post_both(fake, client, "/chat/completions")
    assert copy == own
    headers = copy[3]
    assert headers["authorization"] == f"Bearer {API_KEY}" and headers["x-trace"] == "abc"
    assert headers["x-stainless-read-timeout"] == "7.5" and copy[4] == BODY


async def test_a_copy_sends_what_the_sdk_sends_to_azure(fake: FakeOpenAI, azure: Any) -> None:
    own, copy = await _post_both(fake, azure, "/chat/completions")
    assert copy == own
    assert copy[1] == "/openai/deployments/gpt-test/chat/completions"
    assert copy[2] == {"api-version": "2024-10-21"} and copy[3]["api-key"] == API_KEY


async def test_each_call_keeps_its_own_timeout_and_headers(fake: FakeOpenAI, client: Any) -> None:
    posts = openai_send.PreparedPosts(client)
    await (await posts.post("/chat/completions", BODY, OPTIONS)).aclose()
    plain = {"security": {"bearer_auth": True}}
    await (await posts.post("/chat/completions", BODY, plain)).aclose()
    first, second = (r.headers for r in fake.server.requests[-2:])
    assert first["x-stainless-read-timeout"] == "7.5" and first["x-trace"] == "abc"
    assert second["x-stainless-read-timeout"] == "30" and "x-trace" not in second  # the client's own


# --- the same errors -----------------------------------------------------------------------------


async def _error_of(send: Any) -> BaseException:
    try:
        response = await send
    except Exception as exc:
        return exc
    await response.aclose()
    raise AssertionError("no error raised")


async def test_a_status_error_is_the_sdks_own(fake: FakeOpenAI, client: Any) -> None:
    body = {"error": {"message": "slow down", "type": "requests", "code": "rate_limit_exceeded"}}
    posts = openai_send.PreparedPosts(client)
    errors = []
    for send in (rawhttp.post, lambda *a: posts.post(*a[1:])):
        fake.server.fail_next(Fault(status=429, body=body, headers={"retry-after": "3"}))
        errors.append(await _error_of(send(client, "/chat/completions", BODY, OPTIONS)))
    own, copy = errors
    assert type(copy) is type(own) is openai.RateLimitError
    assert (copy.status_code, copy.body, copy.message) == (own.status_code, own.body, own.message)
    assert copy.response.headers["retry-after"] == "3"


async def test_an_error_body_over_the_limit_is_unreadable(
    fake: FakeOpenAI, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK read an error body whole, however long; a copy's is read bounded."""
    monkeypatch.setattr(rawhttp, "MAX_BODY_BYTES", 1000)
    fake.server.fail_next(Fault(status=500, body={"error": {"message": "x" * 5000}}))
    error = await _error_of(openai_send.PreparedPosts(client).post("/chat/completions", BODY, OPTIONS))
    assert isinstance(error, UnreadableAnswer) and "over gengate's limit of 1000" in str(error)


async def test_timeouts_and_refused_connections_are_the_sdks_errors(fake: FakeOpenAI, client: Any) -> None:
    posts = openai_send.PreparedPosts(client)
    fake.server.fail_next(Fault(delay_s=2.0))
    timed_out = await _error_of(posts.post("/chat/completions", BODY, {**OPTIONS, "timeout": 0.2}))
    assert type(timed_out) is openai.APITimeoutError
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with openai.AsyncOpenAI(
        api_key=API_KEY, base_url=f"http://127.0.0.1:{port}/v1", max_retries=0
    ) as closed:
        errors = [
            await _error_of(rawhttp.post(closed, "/chat/completions", BODY, OPTIONS)),
            await _error_of(openai_send.PreparedPosts(closed).post("/chat/completions", BODY, OPTIONS)),
        ]
    assert [type(e) for e in errors] == [openai.APIConnectionError] * 2


# --- auth computed per request ---------------------------------------------------------------------


async def test_a_client_whose_auth_is_computed_per_request_goes_the_sdks_way(fake: FakeOpenAI) -> None:
    fake.reset()
    asked = []

    async def key() -> str:
        asked.append(1)
        return API_KEY

    async with openai.AsyncOpenAI(api_key=key, base_url=f"{fake.server.base_url}/v1", max_retries=0) as sdk:
        posts = openai_send.PreparedPosts(sdk)
        assert openai_send.per_request_auth(sdk) and not posts.prepared
        for _ in range(2):
            await rawhttp.read_object(await posts.post("/chat/completions", BODY, OPTIONS))
    assert len(asked) == 2  # the key asked for each request, as the SDK does
    assert [json.loads(r.raw) for r in fake.server.requests] == [BODY, BODY]
