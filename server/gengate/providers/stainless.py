"""Requests of the Stainless-generated SDKs (openai, anthropic) sent as the SDK's own `request()`
sends them (its auth, URL, headers, timeout and errors) without its per-request cost: ~0.3 ms of
CPU a call, where gengate's own share of a call is ~0.4 ms (bench/README.md). The SDK prepares
and builds one request per route and model, once (`_prepare_options`, `_build_request`,
`_prepare_request`); each call sends a copy with its own body, timeout and headers on the SDK's
own httpx2 client.

A non-2xx answer is read bounded and raised as the SDK's own status error, and a timeout or a
transport failure as its APITimeoutError or APIConnectionError, as `request()` raises them, so
error mapping is unchanged. gengate builds its clients with a fixed key and no SDK retries
(providers.retry retries), so what the SDK computes for a request is the same every time. A
client whose auth is computed per request goes the SDK's whole way on every call: a key or
token provider, credentials, a workload identity, a provider runtime, an Azure AD token, or
custom httpx auth; so does a subclass (Bedrock, Vertex, AWS sign each request), a client with
middleware, and, while a tracer provider is installed, anthropic's client (it traces each call
itself: a span, and the trace context sent upstream). A copy is built for a body of the model
alone, so no caller's prompt stays in it, and carries the client's cookies as they are when it is
sent.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gengate.providers import rawhttp, transport
from gengate.telemetry import tracing_enabled

# Client attributes that, when set, make the SDK compute auth per request.
PER_REQUEST_AUTH = (
    "_api_key_provider",
    "_provider_runtime",
    "workload_identity",
    "_workload_identity_auth",
    "_azure_ad_token_provider",
    "_azure_ad_token",
    "credentials",
)
# The request options a prepared copy can carry; any other goes the SDK's whole way.
_COPIED_OPTIONS = frozenset({"timeout", "headers", "security"})
# Templates kept per client (route x model x auth scheme: a handful from the config); past this
# many, a call goes the SDK's whole way instead of growing the cache.
_MAX_TEMPLATES = 64
# Headers the SDK writes from a request's own timeout: its read timeout (openai, anthropic), and
# the timeout as given (anthropic).
_READ_TIMEOUT = "x-stainless-read-timeout"
_TIMEOUT = "x-stainless-timeout"


@dataclass(frozen=True)
class Sdk:
    """What a copy takes from one SDK package: how it builds options, and the errors its
    `request()` raises for a transport failure (timeouts first, then the rest; its own errors
    pass as they are)."""

    final_request_options: Any
    get_platform: Any
    timeouts: tuple[type[BaseException], ...]
    transport_errors: tuple[type[BaseException], ...]
    own_error: type[BaseException]
    timeout_error: Any
    connection_error: Any

    @classmethod
    def of(cls, package: str) -> Sdk:
        """The parts of the `openai` or `anthropic` package."""
        import httpx2

        sdk = importlib.import_module(package)
        base = importlib.import_module(f"{package}._base_client")
        models = importlib.import_module(f"{package}._models")
        if package == "openai":
            from openai._httpx2 import request_exceptions, timeout_exceptions

            timeouts, transport, own = timeout_exceptions(), request_exceptions(), sdk.OpenAIError
        else:  # anthropic's request(): any exception but its own is a connection error
            timeouts, transport, own = (httpx2.TimeoutException,), (Exception,), sdk.AnthropicError
        return cls(
            models.FinalRequestOptions,
            base.get_platform,
            timeouts,
            transport,
            own,
            sdk.APITimeoutError,
            sdk.APIConnectionError,
        )


# Environment variables that set an HTTP proxy (httpx reads them, upper or lower case).


def aiohttp_client(sdk: Any, timeout: float, environ: Mapping[str, str] | None = None) -> Any | None:
    """The SDK's aiohttp client as its `DefaultAioHttpClient` builds it (an httpx2 client on the
    httpx-aiohttp transport the SDK vendors, with its timeout, connection limits and redirects)
    but on gengate's session and write bound (providers.transport); ~15-20% less server CPU a
    call than httpx2's own transport (bench/README.md). None, for the SDK's default httpx2
    client, when a proxy is set in the environment (the transport would drop it) or aiohttp is
    not installed."""
    if transport.proxy_in_environment(environ):
        return None
    package = sdk.__name__
    limits = importlib.import_module(f"{package}._constants").DEFAULT_CONNECTION_LIMITS
    client = transport.httpx2_client(
        transport_module=f"{package}._vendor.httpx_aiohttp",
        limits=limits,
        environ=environ,
        timeout=timeout,
        follow_redirects=True,
    )
    return client if transport.on_aiohttp(client) else None  # (else: no vendored transport)


def per_request_auth(client: Any) -> bool:
    """Whether the SDK computes `client`'s auth per request (then nothing is prepared)."""
    if client.custom_auth is not None:
        return True
    return any(getattr(client, name, None) is not None for name in PER_REQUEST_AUTH)


def preparable(client: Any, package: str) -> bool:
    """Whether copies of `client`'s requests are what the SDK would send: one of the clients
    gengate builds, exactly (a subclass may sign or change each request: Bedrock, Vertex, AWS),
    without middleware or auth computed per request."""
    if type(client).__name__ not in _PREPARABLE[package] or not type(client).__module__.startswith(package):
        return False
    return not getattr(client, "_middleware", None) and not per_request_auth(client)


_PREPARABLE = {"openai": ("AsyncOpenAI", "AsyncAzureOpenAI"), "anthropic": ("AsyncAnthropic",)}


class PreparedPosts:
    """POSTs for one client of a Stainless SDK, each a copy of a request the SDK built once."""

    def __init__(self, client: Any, package: str) -> None:
        self.client = client
        self.sdk = Sdk.of(package)
        self.prepared = preparable(client, package)
        # anthropic traces each call itself (a span, the trace context sent on) whenever a tracer
        # provider is installed: then its own whole way, so traces stay as they were.
        self._sdk_traces = package == "anthropic"
        self._templates: dict[tuple[str, Any, Any], Any] = {}
        self._lock = asyncio.Lock()

    async def post(self, path: str, body: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        """The answer to POST `body` at `path`, unread (the caller closes it), as rawhttp.post
        returns it; the SDK's status error for an answer that is not 2xx."""
        if (
            not self.prepared
            or not _COPIED_OPTIONS.issuperset(options)
            or (self._sdk_traces and tracing_enabled())
        ):
            return await rawhttp.post(self.client, path, body, options)
        security = options.get("security")
        key = (path, body.get("model"), tuple(sorted(security.items())) if security else None)
        template = self._templates.get(key)
        if template is None:
            template = await self._template(key, path, body.get("model"), security)
            if template is None:  # past _MAX_TEMPLATES
                return await rawhttp.post(self.client, path, body, options)
        request = self._copy(template, body, options)
        sdk = self.sdk
        try:
            response = await self.client._client.send(request, stream=True)
        except sdk.timeouts as exc:
            raise sdk.timeout_error(request=request) from exc
        except sdk.own_error:
            raise
        except sdk.transport_errors as exc:
            raise sdk.connection_error(request=request) from exc
        if not response.is_success:  # as request() raises for any status but 2xx
            raise self.client._make_status_error_from_response(await rawhttp.read_error(response)) from None
        return response

    def _copy(self, template: Any, body: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        """The template with this call's body, headers and timeout, and the client's cookies as
        they are now (httpx adds them when a request is built; the SDK builds one per call)."""
        import httpx2

        headers = template.headers.copy()
        extra = options.get("headers")
        custom = {k.lower() for k in extra} if extra else set()
        if extra:
            headers.update(extra)
        extensions = dict(template.extensions)
        given = options.get("timeout")
        if given is not None:
            timeout = given if isinstance(given, httpx2.Timeout) else httpx2.Timeout(given)
            extensions["timeout"] = timeout.as_dict()
            if _READ_TIMEOUT not in custom:
                headers[_READ_TIMEOUT] = str(timeout.read)
            if _TIMEOUT in headers and _TIMEOUT not in custom:
                headers[_TIMEOUT] = str(given)
        request = httpx2.Request(
            "POST", template.url, headers=headers, content=orjson.dumps(body), extensions=extensions
        )
        cookies = self.client._client.cookies
        if cookies:
            cookies.set_cookie_header(request)
        return request

    async def _template(self, key: tuple[str, Any, Any], path: str, model: Any, security: Any) -> Any:
        """The SDK's own request for `key`, built as `request()` builds it, for a body of the model
        alone (no caller's prompt is kept; Azure routes by the model), without the body's length,
        its cookies or a call's timeout, which each copy has its own of. None past _MAX_TEMPLATES."""
        client = self.client
        async with self._lock:
            template = self._templates.get(key)
            if template is not None or len(self._templates) >= _MAX_TEMPLATES:
                return template
            if client._platform is None:  # as request() does: get_platform may block on I/O
                client._platform = await asyncio.to_thread(self.sdk.get_platform)
            fields: dict[str, Any] = {"method": "post", "url": path, "json_data": {"model": model}}
            if security:
                fields["security"] = security
            prepared = await client._prepare_options(self.sdk.final_request_options.construct(**fields))
            template = client._build_request(prepared, retries_taken=0)
            await client._prepare_request(template)
            for name in ("content-length", "cookie"):
                template.headers.pop(name, None)
            self._templates[key] = template
            return template
