"""gengate.providers.errors, the one place any provider's failure becomes a gengate status: each HTTP
status and error text maps to its status class, reason, retry hint and metadata; every message
keeps the upstream's detail (errors are never hidden) and never a key (keys never in errors)."""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

import pytest
from gengate import errors
from gengate.providers.errors import (
    UPSTREAM_AUTH_FAILED,
    UPSTREAM_BAD_REQUEST,
    UPSTREAM_BAD_RESPONSE,
    UPSTREAM_PROTOCOL,
    UPSTREAM_RATE_LIMITED,
    UPSTREAM_TIMEOUT,
    UPSTREAM_UNAVAILABLE,
    from_status,
    is_retryable,
    normalize_exception,
    parse_retry_after,
    scrub,
)
from gengate.redaction import REDACTED, register_secret

KEY = "gg-test-provider-key-0123456789abcdef"
register_secret(KEY)

# (status, body, error_type, class, reason)
MAPPING: list[tuple[int, Any, str | None, type[errors.GengateError], str]] = [
    (401, "nope", None, errors.Internal, UPSTREAM_AUTH_FAILED),
    (403, "nope", None, errors.Internal, UPSTREAM_AUTH_FAILED),
    (400, "Invalid API key provided", None, errors.Internal, UPSTREAM_AUTH_FAILED),
    (500, "incorrect api key", None, errors.Internal, UPSTREAM_AUTH_FAILED),
    (400, "x", "authentication_error", errors.Internal, UPSTREAM_AUTH_FAILED),
    # A 429 is a rate limit whatever its body says.
    (429, "unauthorized", None, errors.ResourceExhausted, UPSTREAM_RATE_LIMITED),
    (400, "Rate limit reached", None, errors.ResourceExhausted, UPSTREAM_RATE_LIMITED),
    (503, "overloaded", None, errors.ResourceExhausted, UPSTREAM_RATE_LIMITED),
    (529, "x", "overloaded_error", errors.ResourceExhausted, UPSTREAM_RATE_LIMITED),
    (400, "x", "RESOURCE_EXHAUSTED", errors.ResourceExhausted, UPSTREAM_RATE_LIMITED),
    # Rate words on another status are not a rate limit.
    (500, "quota", None, errors.Unavailable, UPSTREAM_UNAVAILABLE),
    (422, "quota", None, errors.InvalidArgument, UPSTREAM_BAD_REQUEST),
    (408, "slow", None, errors.DeadlineExceeded, UPSTREAM_TIMEOUT),
    (504, "slow", None, errors.DeadlineExceeded, UPSTREAM_TIMEOUT),
    (500, "boom", None, errors.Unavailable, UPSTREAM_UNAVAILABLE),
    (502, "boom", None, errors.Unavailable, UPSTREAM_UNAVAILABLE),
    (409, "busy", None, errors.Unavailable, UPSTREAM_UNAVAILABLE),
    (404, "no such model", None, errors.InvalidArgument, UPSTREAM_BAD_REQUEST),
    (400, "bad field", None, errors.InvalidArgument, UPSTREAM_BAD_REQUEST),
    (499, "bad field", None, errors.InvalidArgument, UPSTREAM_BAD_REQUEST),
    (
        400,
        "This model's maximum context length is 8192",
        None,
        errors.InvalidArgument,
        "UPSTREAM_CONTEXT_LENGTH",
    ),
    (413, "prompt is too long", None, errors.InvalidArgument, "UPSTREAM_CONTEXT_LENGTH"),
]


@pytest.mark.parametrize(
    ("status", "body", "error_type", "cls", "reason"),
    MAPPING,
    ids=[f"{m[0]}-{m[4]}-{i}" for i, m in enumerate(MAPPING)],
)
def test_a_status_maps_by_meaning(
    status: int, body: Any, error_type: str | None, cls: type[errors.GengateError], reason: str
) -> None:
    error = from_status(status, body, provider="acme", error_type=error_type)
    assert type(error) is cls
    assert error.reason == reason
    assert error.metadata == {"provider": "acme", "upstream_status": str(status)}
    assert "acme" in error.message
    if status == 404:
        assert "(HTTP 404)" in error.message
    if cls is errors.Internal:
        # Our credentials: the message says so and carries nothing of the upstream's body.
        assert body not in error.message
        assert f"(HTTP {status})" in error.message
    else:
        assert error.message.endswith(": " + body)


def test_the_default_provider_name_is_provider() -> None:
    error = from_status(500, "boom")
    assert error.metadata["provider"] == "provider"
    assert error.message.startswith("provider ")


def test_retry_hints() -> None:
    assert from_status(429, "x").retry_after_s == 1.0  # no header: a second
    assert from_status(429, "x", headers={"retry-after": "7"}).retry_after_s == 7.0
    assert from_status(400, "rate limit", headers={"Retry-After-Ms": "250"}).retry_after_s == 0.25
    assert from_status(503, "down", headers={"retry-after": "3"}).retry_after_s == 3.0
    assert from_status(503, "down").retry_after_s is None
    for no_hint in (
        from_status(408, "x", headers={"retry-after": "3"}),
        from_status(400, "x"),
        from_status(401, "x", headers={"retry-after": "3"}),
    ):
        assert no_hint.retry_after_s is None


def test_parse_retry_after() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after({}) is None
    assert parse_retry_after({"x-other": "1"}) is None
    assert parse_retry_after({"retry-after-ms": "1500"}) == 1.5
    assert parse_retry_after({"Retry-After": "3"}) == 3.0
    assert parse_retry_after({"retry-after": "2.5"}) == 2.5
    assert parse_retry_after({"retry-after": "-4"}) == 0.0
    assert parse_retry_after({"retry-after-ms": "-4"}) == 0.0
    assert parse_retry_after({"retry-after-ms": "0"}) == 0.0
    # A broken ms header falls back to retry-after; an empty one is not there.
    assert parse_retry_after({"retry-after-ms": "soon", "retry-after": "2"}) == 2.0
    assert parse_retry_after({"retry-after-ms": "", "retry-after": "2"}) == 2.0
    assert parse_retry_after({"retry-after": ""}) is None
    assert parse_retry_after({"retry-after": "whenever"}) is None
    past = email.utils.formatdate(time.time() - 3600, usegmt=True)
    assert parse_retry_after({"retry-after": past}) == 0.0
    future = email.utils.formatdate(time.time() + 3600, usegmt=True)
    wait = parse_retry_after({"retry-after": future})
    assert wait is not None and 3000 < wait <= 3600


# (body, the detail the message ends with)
BODIES: list[tuple[Any, str]] = [
    ({"error": {"message": "openai says"}}, "openai says"),
    ({"error": {"message": "", "detail": "detail wins"}}, "detail wins"),
    ({"error": {"error": "nested error"}}, "nested error"),
    ({"error": {"msg": "short msg"}}, "short msg"),
    ({"error": "plain error"}, "plain error"),
    ({"message": "top message"}, "top message"),
    ({"detail": "top detail"}, "top detail"),
    ({"error": {"code": 5}, "message": "beside"}, "beside"),
    ({"error": 5, "detail": "beside detail"}, "beside detail"),
    ({"error": {"code": 5}}, json.dumps({"error": {"code": 5}})),
    ([1, 2], "[1, 2]"),
    (json.dumps({"error": {"message": "from json text"}}).encode(), "from json text"),
    (b"not json \xff", "not json \ufffd"),
    ("just text", "just text"),
    (None, ""),
]


@pytest.mark.parametrize(("body", "detail"), BODIES, ids=[str(i) for i in range(len(BODIES))])
def test_the_upstream_detail_is_kept_in_the_message(body: Any, detail: str) -> None:
    assert from_status(500, body, provider="acme").message == f"acme is unavailable (HTTP 500): {detail}"


def test_an_unserialisable_body_is_kept_as_text() -> None:
    body = {"message": 5, "when": object()}
    assert "'message': 5" in from_status(500, body).message


def test_keys_never_reach_a_message() -> None:
    body = {"error": {"message": f"bad request for key {KEY}"}}
    for status in (400, 401, 404, 429, 500, 504):
        message = from_status(status, body).message
        assert KEY not in message
    assert REDACTED in from_status(500, body).message
    # Cut to length after redaction: a key across the cut leaves no half behind.
    text = "x" * 990 + KEY
    out = scrub(text)
    assert KEY[:8] not in out
    assert len(scrub("y" * 5000)) <= 1001
    assert scrub("short") == "short"


class _Http(Exception):
    def __init__(self, text: str, **attrs: Any) -> None:
        super().__init__(text)
        for name, value in attrs.items():
            setattr(self, name, value)


class _Response:
    def __init__(self, status_code: Any, headers: dict[str, str] | None = None) -> None:
        self.status_code = status_code
        self.headers = headers or {}


class ReadTimeout(Exception):
    pass


class SSEError(Exception):
    pass


class ConnectError(Exception):
    pass


class RemoteProtocolError(Exception):
    pass


# The transport errors' names, as httpx and the SDKs spell them, each alone (not an OSError).
TRANSPORT_ERRORS = [type(name, (Exception,), {}) for name in ("TransportError", "NetworkError", "ReadError")]


def test_sdk_exceptions_with_a_status_map_like_the_status() -> None:
    error = normalize_exception(
        _Http("x", status_code=503, body={"error": {"message": "down"}}), provider="acme"
    )
    assert type(error) is errors.Unavailable and error.message.endswith(": down")
    assert error.metadata == {"provider": "acme", "upstream_status": "503"}
    # The status from .status, .http_status, or the response; the headers from either.
    assert normalize_exception(_Http("x", status=404)).reason == UPSTREAM_BAD_REQUEST
    assert type(normalize_exception(_Http("x", http_status=401))) is errors.Internal
    limited = normalize_exception(_Http("x", response=_Response(429, {"Retry-After": "4"})))
    assert type(limited) is errors.ResourceExhausted and limited.retry_after_s == 4.0
    limited = normalize_exception(_Http("x", status_code=429, headers={"retry-after": "6"}))
    assert limited.retry_after_s == 6.0
    # No body: the exception's message, else its text.
    assert normalize_exception(_Http("text", status_code=500, message="msg")).message.endswith(": msg")
    assert normalize_exception(_Http("text", status_code=500)).message.endswith(": text")
    # The SDK's error type or code counts; a non-string code does not.
    assert (
        normalize_exception(_Http("x", status_code=400, type="rate_limit_error")).reason
        == UPSTREAM_RATE_LIMITED
    )
    assert (
        normalize_exception(_Http("x", status_code=400, code="invalid_api_key")).reason
        == UPSTREAM_AUTH_FAILED
    )
    assert normalize_exception(_Http("x", status_code=400, code=7)).reason == UPSTREAM_BAD_REQUEST


def test_a_status_that_is_not_an_http_error_is_not_mapped_as_one() -> None:
    # 3xx, or not an HTTP status at all: a response gengate could not read.
    for attrs in (
        {"status_code": 302},
        {"status_code": 99},
        {"status_code": 600},
        {"status": "500"},
        {"response": _Response(200)},
        {"response": _Response("500")},
    ):
        error = normalize_exception(_Http("odd", **attrs))
        assert type(error) is errors.Unavailable and error.reason == UPSTREAM_BAD_RESPONSE
    # .status_code out of range does not hide a real status on the response.
    assert normalize_exception(_Http("x", status_code=0, response=_Response(504))).reason == UPSTREAM_TIMEOUT
    assert (
        normalize_exception(_Http("x", status_code=600, response=_Response(404))).reason
        == UPSTREAM_BAD_REQUEST
    )


def test_transport_failures_map_to_their_status() -> None:
    for timeout in (TimeoutError(), ReadTimeout("read")):
        error = normalize_exception(timeout, provider="acme")
        assert type(error) is errors.DeadlineExceeded and error.reason == UPSTREAM_TIMEOUT
        assert "acme" in error.message
    sse = normalize_exception(SSEError(f"got text/html with {KEY}"), provider="acme")
    assert type(sse) is errors.Unavailable and sse.reason == UPSTREAM_PROTOCOL
    assert "got text/html" in sse.message and KEY not in sse.message
    for broken in (
        *(cls("down") for cls in TRANSPORT_ERRORS),
        ConnectionRefusedError(f"refused {KEY}"),
        OSError("unreachable"),
        ConnectError("dns"),
        RemoteProtocolError("eof"),
    ):
        error = normalize_exception(broken, provider="acme")
        assert type(error) is errors.Unavailable and error.reason == UPSTREAM_UNAVAILABLE
        assert error.message.startswith("cannot reach acme: ") and KEY not in error.message
    assert normalize_exception(ConnectError("")).message == "cannot reach provider: ConnectError"
    odd = normalize_exception(ValueError(f"unexpected {KEY}"), provider="acme")
    assert type(odd) is errors.Unavailable and odd.reason == UPSTREAM_BAD_RESPONSE
    assert "unexpected" in odd.message and KEY not in odd.message
    assert normalize_exception(KeyError()).message.endswith(": KeyError")


def test_a_gengate_error_passes_through_scrubbed() -> None:
    original = errors.InvalidArgument(f"bad {KEY}", reason="MINE")
    out = normalize_exception(original)
    assert out is original and out.reason == "MINE"
    assert KEY not in out.message and REDACTED in out.message


def test_only_rate_limits_and_unavailability_are_retried() -> None:
    assert is_retryable(errors.ResourceExhausted("x"))
    assert is_retryable(errors.Unavailable("x"))
    for final in (
        errors.Internal("x"),
        errors.InvalidArgument("x"),
        errors.DeadlineExceeded("x"),
        errors.Unimplemented("x"),
    ):
        assert not is_retryable(final)


def _raised_from(top: BaseException, cause: BaseException) -> BaseException:
    """`top` as raised `from cause` (the chain a transport's exception map builds)."""
    try:
        raise top from cause
    except BaseException as exc:
        return exc


def test_aiohttp_failures_under_httpx_names_map_by_what_happened() -> None:
    """httpx-aiohttp raises every aiohttp connection error as httpx's ConnectTimeout: a refusal
    or a hang-up is unreachable (retried), a timeout of aiohttp's or the kernel's a timeout, and
    an answer aiohttp could not parse (its ClientResponseError says 400) the upstream's fault."""
    import errno

    import aiohttp
    from aiohttp import http_exceptions
    from aiohttp.client_reqrep import ConnectionKey
    from httpx import ConnectTimeout

    key = ConnectionKey("upstream", 443, True, True, None, None, None, None)
    unreachable = (
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientConnectorError(key, ConnectionRefusedError(errno.ECONNREFUSED, "refused")),
        aiohttp.ClientOSError(errno.ECONNRESET, "reset"),
        ConnectionRefusedError(errno.ECONNREFUSED, "refused"),  # a transport's own mapping of it
    )
    for cause in unreachable:
        error = normalize_exception(_raised_from(ConnectTimeout("mapped"), cause), provider="acme")
        assert type(error) is errors.Unavailable and error.reason == UPSTREAM_UNAVAILABLE, cause
    timeouts = (
        aiohttp.ConnectionTimeoutError("pool"),
        aiohttp.SocketTimeoutError("read"),
        aiohttp.ClientConnectorError(key, OSError(errno.ETIMEDOUT, "timed out")),
    )
    for cause in timeouts:
        error = normalize_exception(_raised_from(ConnectTimeout("mapped"), cause), provider="acme")
        assert type(error) is errors.DeadlineExceeded and error.reason == UPSTREAM_TIMEOUT, cause
    # A timeout raised while an earlier hang-up was handled is a timeout: the chain is read to
    # the first timeout, not past it.
    later = _raised_from(TimeoutError("the retry timed out"), aiohttp.ServerDisconnectedError())
    assert type(normalize_exception(later)) is errors.DeadlineExceeded
    unparsable = _raised_from(
        aiohttp.ClientResponseError(None, (), status=400, message="Got more than 65536 bytes"),
        http_exceptions.LineTooLong("header", "65536"),
    )
    error = normalize_exception(unparsable, provider="acme")
    assert type(error) is errors.Unavailable and error.reason == UPSTREAM_BAD_RESPONSE
    assert "could not be parsed" in error.message
