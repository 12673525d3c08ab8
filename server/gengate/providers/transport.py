"""The HTTP clients the httpx-based provider SDKs (cohere, mistralai, google-genai on httpx;
huggingface_hub on httpx2) send on: httpx's client (its auth, cookies, redirects, timeouts and
errors, as each SDK expects) over aiohttp's connection pool and C parser, through httpx-aiohttp's
transport, for ~20-35% less server CPU a call than httpx's own pure-Python transport
(bench/README.md). The openai and anthropic SDKs ship the same transport
(`DefaultAioHttpClient`, providers.stainless).

httpx's own transport is kept where aiohttp's would differ: with a proxy set in the environment
(HTTP(S)_PROXY, ALL_PROXY; httpx's SOCKS and NO_PROXY handling stay as they are), or without
httpx-aiohttp installed. The aiohttp session takes no cookies of its own (httpx keeps them) and
has no connection cap unless the limits give one.

Either way, a response reaches the client's cookie jar only when it sets a cookie
(`cookies_read_when_set`): httpx wraps every response and its request in urllib's forms for the
jar to find none, about a sixth of a unary call's server CPU.

httpx-aiohttp reads a refused connection, or one the upstream closed, as httpx's ConnectTimeout;
providers.errors looks down the chain of causes and maps those as unreachable, not as timeouts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import httpx

PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")

Client = TypeVar("Client", bound=httpx.AsyncClient)


def proxy_in_environment(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a proxy is set in the environment (either case), which aiohttp's transport would
    not honour as httpx does."""
    env = os.environ if environ is None else environ
    return any(env.get(name) or env.get(name.lower()) for name in PROXY_VARIABLES)


def httpx_client(
    cls: type[Client] = httpx.AsyncClient,  # type: ignore[assignment]  # the default is a Client
    *,
    limits: httpx.Limits | None = None,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Client:
    """An httpx `cls` client sending on aiohttp (module docstring), or on httpx's own transport
    when a proxy is set or httpx-aiohttp is missing; `kwargs` go to the client as they are."""
    limits = limits or httpx.Limits()
    transport = None if proxy_in_environment(environ) else _aiohttp_transport("httpx_aiohttp", limits)
    if transport is None:
        return cookies_read_when_set(cls(limits=limits, **kwargs))
    return cookies_read_when_set(cls(transport=transport, **kwargs))


def httpx2_client(*, limits: Any = None, environ: Mapping[str, str] | None = None, **kwargs: Any) -> Any:
    """The same as `httpx_client` for httpx2 (huggingface_hub's HTTP library)."""
    import httpx2

    limits = limits or httpx2.Limits()
    transport = None if proxy_in_environment(environ) else _aiohttp_transport("httpx_aiohttp.httpx2", limits)
    if transport is None:
        return cookies_read_when_set(httpx2.AsyncClient(limits=limits, **kwargs))
    return cookies_read_when_set(httpx2.AsyncClient(transport=transport, **kwargs))


AnyClient = TypeVar("AnyClient")


def cookies_read_when_set(client: AnyClient) -> AnyClient:
    """`client` (httpx or httpx2) with a cookie jar that reads a response only when it has a
    Set-Cookie (or Set-Cookie2) header: the same cookies kept, without the urllib wrapping of
    every response that finds none. A jar assigned later (`client.cookies = ...`) is httpx's own."""
    jar: Any = getattr(client, "_cookies", None)
    if jar is not None:
        cast(Any, client)._cookies = _jar_class(type(jar))(jar)
    return client


def _jar_class(base: type[Any]) -> type[Any]:
    """A subclass of httpx's (or httpx2's) `Cookies` that skips a response setting none."""
    made = _JAR_CLASSES.get(base)
    if made is None:

        def extract_cookies(self: Any, response: Any) -> None:
            headers = response.headers
            if "set-cookie" in headers or "set-cookie2" in headers:
                base.extract_cookies(self, response)

        made = type(
            "CookiesReadWhenSet", (base,), {"extract_cookies": extract_cookies, "__module__": __name__}
        )
        _JAR_CLASSES[base] = made
    return made


_JAR_CLASSES: dict[type[Any], type[Any]] = {}


def on_aiohttp(client: Any) -> bool:
    """Whether `client` (httpx or httpx2) sends on aiohttp's transport."""
    return type(getattr(client, "_transport", None)).__name__ == "AiohttpTransport"


def _aiohttp_transport(module: str, limits: Any) -> Any | None:
    """httpx-aiohttp's transport (of `module`: its httpx or httpx2 flavour) with gengate's
    session, or None when the package is not installed."""
    import importlib

    try:
        transport: Any = importlib.import_module(module).AiohttpTransport(limits=limits)
    except ImportError:
        return None
    # A callable `client` is how the transport takes a session it did not build; it is called
    # at the first request, inside the event loop the session belongs to.
    transport.client = lambda: _session(transport.ssl_context, limits)
    return transport


def _session(ssl_context: Any, limits: Any) -> Any:
    """The aiohttp session under one client: httpx's TLS context (its CA bundle, SSL_CERT_FILE),
    its connection cap (none when None) and keep-alive, and no cookie jar (httpx keeps them)."""
    import aiohttp

    connector = aiohttp.TCPConnector(
        limit=limits.max_connections or 0,
        keepalive_timeout=limits.keepalive_expiry,
        ssl=ssl_context,
    )
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())
