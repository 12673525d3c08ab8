"""The HTTP clients the provider SDKs send on: httpx's (or httpx2's) client, with its auth,
cookies, redirects, timeouts and errors as each SDK expects, over aiohttp's connection pool and C
parser through httpx-aiohttp's transport. That is ~20-35% less server CPU a call than httpx's own
pure-Python transport (bench/README.md). cohere, mistralai and google-genai get an httpx client,
huggingface_hub an httpx2 one. openai and anthropic get an httpx2 client on the copy of the
transport they vendor (providers.stainless).

httpx's own transport is kept where aiohttp's would differ: with a proxy set in the environment
(HTTP(S)_PROXY, ALL_PROXY; httpx's SOCKS and NO_PROXY handling stay as they are), with a setting
only httpx's transport takes (`verify`, `http2`, ...), or without httpx-aiohttp installed.

Where the two transports differ, the session is made to match httpx:
- its connection cap is httpx's (100 unless the limits give one; aiohttp has no cap on idle
  connections);
- it keeps no cookies of its own (httpx keeps them);
- it reads header lines up to 64 KiB;
- a body over 64 KiB that the upstream stops reading ends, after the request's timeouts added
  together, as httpx's WriteTimeout (aiohttp has no write timeout).

On either transport, a response reaches the client's cookie jar only when it sets a cookie
(`cookies_read_when_set`). Otherwise httpx wraps every response and its request in urllib's forms,
only for the jar to find nothing.

httpx-aiohttp raises a refused connection, or one the upstream closed, as httpx's ConnectTimeout.
providers.errors looks down the chain of causes and maps those as unreachable, not as timeouts.
"""

from __future__ import annotations

import asyncio
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
    when a proxy is set, httpx-aiohttp is missing or `kwargs` name a setting only httpx's own
    transport takes; `kwargs` go to the client as they are. `limits` default to httpx's own."""
    client: Client = _build(httpx, cls, "httpx_aiohttp", limits, environ, kwargs)
    return client


def httpx2_client(
    *,
    limits: Any = None,
    environ: Mapping[str, str] | None = None,
    transport_module: str = "httpx_aiohttp.httpx2",
    **kwargs: Any,
) -> Any:
    """The same as `httpx_client` for httpx2 (huggingface_hub's, openai's and anthropic's HTTP
    library). `transport_module` holds the AiohttpTransport class: httpx-aiohttp's, or the copy
    an SDK vendors (`openai._vendor.httpx_aiohttp`)."""
    import httpx2

    return _build(httpx2, httpx2.AsyncClient, transport_module, limits, environ, kwargs)


def _build(
    flavour: Any,
    cls: Any,
    module: str,
    limits: Any,
    environ: Mapping[str, str] | None,
    kwargs: dict[str, Any],
) -> Any:
    """A `cls` client of `flavour` (the httpx or httpx2 module) on `module`'s AiohttpTransport,
    or on httpx's own (module docstring); limits default to httpx's own."""
    limits = limits or flavour.Limits(max_connections=100, max_keepalive_connections=20)
    transport = None
    if not proxy_in_environment(environ) and not _TRANSPORT_SETTINGS & kwargs.keys():
        transport = _aiohttp_transport(module, flavour, limits)
    if transport is None:
        return cookies_read_when_set(cls(limits=limits, **kwargs))
    return cookies_read_when_set(cls(transport=transport, **kwargs))


# Client settings httpx hands to the transport it builds: with a transport given they would be
# dropped, so a client given any of them keeps httpx's own.
_TRANSPORT_SETTINGS = frozenset(
    {"verify", "cert", "trust_env", "http1", "http2", "proxy", "mounts", "transport"}
)


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


def _aiohttp_transport(module: str, flavour: Any, limits: Any) -> Any | None:
    """httpx-aiohttp's transport (of `module`: its httpx or httpx2 flavour) with gengate's
    session and httpx's write timeout, or None when the package is not installed."""
    import importlib

    try:
        base = importlib.import_module(module).AiohttpTransport
    except ImportError:
        return None
    transport: Any = _write_bounded(base, flavour)(limits=limits)
    # A callable `client` is how the transport takes a session it did not build; it is called
    # at the first request, inside the event loop the session belongs to.
    transport.client = lambda: _session(transport.ssl_context, limits)
    return transport


def _write_bounded(base: type[Any], flavour: Any) -> type[Any]:
    """`base` (httpx-aiohttp's transport class) bounding the wait for a response's headers by
    the sum of the request's pool, connect, write and read timeouts, all four set, as httpx
    WriteTimeout, for a body over WRITTEN_AT_ONCE_BYTES or of unknown length. aiohttp has no
    write timeout of its own, so an upstream that stops reading a request body would otherwise
    hold the call until its deadline, or for ever without one."""
    made = _BOUNDED.get(base)
    if made is not None:
        return made

    async def handle_async_request(self: Any, request: Any) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) <= WRITTEN_AT_ONCE_BYTES:
            return await base.handle_async_request(self, request)  # no write can stall
        timeout = request.extensions.get("timeout", {})
        parts = [timeout.get(name) for name in ("pool", "connect", "write", "read")]
        if any(part is None for part in parts):
            return await base.handle_async_request(self, request)
        try:
            async with asyncio.timeout(sum(parts)) as scope:
                return await base.handle_async_request(self, request)
        except TimeoutError as exc:
            if scope.expired():
                raise flavour.WriteTimeout(
                    f"no answer within the request's timeouts ({sum(parts):g} s in all): the request "
                    "was not read or not answered",
                    request=request,
                ) from exc
            raise

    made = type(
        "AiohttpTransport", (base,), {"handle_async_request": handle_async_request, "__module__": __name__}
    )
    _BOUNDED[base] = made
    return made


_BOUNDED: dict[type[Any], type[Any]] = {}
# A body this long goes into asyncio's write buffer at once (its high-water mark is 64 KiB), so
# its write cannot stall: the bound is left off it, the usual request, at no cost.
WRITTEN_AT_ONCE_BYTES = 64 * 1024

# The longest response line, and header field, the session reads (aiohttp's default is 8190
# bytes, where h11 under httpx takes 16 KiB in all; a proxy's or CDN's header can be long).
MAX_HEADER_BYTES = 64 * 1024


def _session(ssl_context: Any, limits: Any) -> Any:
    """The aiohttp session under one client: httpx's TLS context (its CA bundle, SSL_CERT_FILE),
    its connection cap (none when None; aiohttp has no cap on idle connections) and keep-alive,
    headers up to MAX_HEADER_BYTES, and no cookie jar (httpx keeps them)."""
    import aiohttp

    connector = aiohttp.TCPConnector(
        limit=limits.max_connections or 0,
        keepalive_timeout=limits.keepalive_expiry,
        ssl=ssl_context,
    )
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        max_line_size=MAX_HEADER_BYTES,
        max_field_size=MAX_HEADER_BYTES,
    )
