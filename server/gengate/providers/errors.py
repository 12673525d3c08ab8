"""Provider errors normalised in one place: any SDK's exception becomes a gengate error.

Mapping is by meaning (status code *and* error type/body text), because providers in the wild
misuse codes: a 400 whose body says "rate limit" is a 429, a 500 whose body says "invalid
api key" is our bad credential. Every message is redacted (gengate.redaction) before it is cut
to length.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import json
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

from gengate import errors
from gengate.redaction import redact_and_cut
from gengate.redaction import register_secret as register_secret  # where providers used to find it

UPSTREAM_AUTH_FAILED = "UPSTREAM_AUTH_FAILED"
UPSTREAM_RATE_LIMITED = "UPSTREAM_RATE_LIMITED"
UPSTREAM_UNAVAILABLE = "UPSTREAM_UNAVAILABLE"
UPSTREAM_TIMEOUT = "UPSTREAM_TIMEOUT"
UPSTREAM_BAD_REQUEST = "UPSTREAM_BAD_REQUEST"
UPSTREAM_BAD_RESPONSE = "UPSTREAM_BAD_RESPONSE"
UPSTREAM_PROTOCOL = "UPSTREAM_PROTOCOL"  # a streaming request answered with no event stream

_MAX_MESSAGE = 1000


class UnreadableAnswer(ValueError):
    """An upstream answer gengate cannot read (no JSON, a field of the wrong kind, over a size
    limit): normalize_exception makes it Unavailable UPSTREAM_BAD_RESPONSE, with this message."""


def scrub(text: str) -> str:
    """`text` without any registered secret or credential-shaped token, then cut to a sane length
    (redacted first: a key straddling the cut must not leave its first half in the message)."""
    return redact_and_cut(text, _MAX_MESSAGE)


def parse_retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds to wait from `retry-after-ms` / `retry-after` (seconds or HTTP date), else None."""
    if not headers:
        return None
    lowered = {k.lower(): v for k, v in headers.items()}
    raw_ms = lowered.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = lowered.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _body_text(body: Any) -> str:
    """The human message inside a provider error body (OpenAI/Anthropic/Cohere shapes), or its JSON."""
    if body is None:
        return ""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str):
        text: str = body
        try:
            body = json.loads(text)
        except ValueError:
            return text
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping):
            for key in ("message", "detail", "error", "msg"):
                value = inner.get(key)
                if isinstance(value, str) and value:
                    return value
        elif isinstance(inner, str):
            return str(inner)
        for key in ("message", "detail"):
            value = body.get(key)
            if isinstance(value, str) and value:
                return value
    try:
        return json.dumps(body)  # cut by `scrub`, after redaction
    except (TypeError, ValueError):
        return str(body)


_AUTH_WORDS = re.compile(
    r"(?i)invalid[_ ]api[_ ]key|incorrect api key|unauthori[sz]ed|authentication|api key not valid"
    r"|permission denied|forbidden|invalid x-api-key"
)
_RATE_WORDS = re.compile(
    r"(?i)rate[_ ]limit|too many requests|quota|overloaded|resource[_ ]exhausted|capacity"
)
_CONTEXT_WORDS = re.compile(r"(?i)context length|maximum context|too many tokens|prompt is too long")


def from_status(
    status: int,
    body: Any = None,
    *,
    headers: Mapping[str, str] | None = None,
    provider: str = "provider",
    error_type: str | None = None,
) -> errors.GengateError:
    """Maps an upstream HTTP status (+ body, error type, headers) to a gengate error by meaning."""
    detail = scrub(_body_text(body))
    kind = (error_type or "").lower()
    text = f"{kind} {detail}"
    retry_after = parse_retry_after(headers)
    meta = {"provider": provider, "upstream_status": str(status)}
    if status in (401, 403) or (status >= 400 and _AUTH_WORDS.search(text) and status != 429):
        # Our credentials, not the caller's: INTERNAL, and the key never enters the message.
        return errors.Internal(
            f"{provider} rejected gengate's credentials (HTTP {status}); check the configured API key",
            reason=UPSTREAM_AUTH_FAILED,
            metadata=meta,
        )
    if status == 429 or (_RATE_WORDS.search(text) and status in (400, 503, 529)):
        return errors.ResourceExhausted(
            f"{provider} is rate limiting or out of quota (HTTP {status}): {detail}",
            reason=UPSTREAM_RATE_LIMITED,
            retry_after_s=retry_after if retry_after is not None else 1.0,
            metadata=meta,
        )
    if status in (408, 504):
        return errors.DeadlineExceeded(
            f"{provider} timed out (HTTP {status}): {detail}", reason=UPSTREAM_TIMEOUT, metadata=meta
        )
    if status >= 500 or status == 409:
        return errors.Unavailable(
            f"{provider} is unavailable (HTTP {status}): {detail}",
            reason=UPSTREAM_UNAVAILABLE,
            retry_after_s=retry_after,
            metadata=meta,
        )
    if status == 404:
        return errors.InvalidArgument(
            f"{provider} does not know the model or endpoint (HTTP 404): {detail}",
            reason=UPSTREAM_BAD_REQUEST,
            metadata=meta,
        )
    reason = "UPSTREAM_CONTEXT_LENGTH" if _CONTEXT_WORDS.search(text) else UPSTREAM_BAD_REQUEST
    return errors.InvalidArgument(f"{provider} rejected the request: {detail}", reason=reason, metadata=meta)


def _headers_of(exc: BaseException) -> Mapping[str, str] | None:
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or getattr(exc, "headers", None)
    if headers is None:
        return None
    try:
        return {str(k): str(v) for k, v in dict(headers).items()}
    except (TypeError, ValueError):
        return None


def _status_of(exc: BaseException) -> int | None:
    for attr in ("status_code", "status", "http_status"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)
    value = getattr(response, "status_code", None)
    return value if isinstance(value, int) else None


def _is_timeout(exc: BaseException) -> bool:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return True
    if _connection_failed(exc):  # (aiohttp's transport for httpx raises these as ConnectTimeout)
        return False
    return any("timeout" in cls.__name__.lower() for cls in type(exc).__mro__)


def _connection_failed(exc: BaseException) -> bool:
    """Whether the connection was refused or failed without timing out, read down the chain of
    causes to the first timeout or aiohttp error: aiohttp's ClientConnectionError (a refusal, a
    server hanging up) that is no timeout of its own, nor a connect the kernel timed out."""
    for seen in _chain(exc):
        if isinstance(seen, TimeoutError):
            return False
        if isinstance(seen, ConnectionRefusedError):
            return True
        if any(cls.__name__ == "ClientConnectionError" for cls in type(seen).__mro__):
            os_error = getattr(seen, "os_error", None)
            return getattr(os_error, "errno", None) != errno.ETIMEDOUT
    return False


def _unparsable(exc: BaseException) -> bool:
    """Whether aiohttp could not parse the upstream's answer (a header over its limit, a bad
    status line): its ClientResponseError then carries status 400, which is no answer of the
    upstream's."""
    return any(any(cls.__name__ == "HttpProcessingError" for cls in type(e).__mro__) for e in _chain(exc))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and its causes (or contexts), at most 16: a chain is short, and a cycle must end."""
    seen: BaseException | None = exc
    for _ in range(16):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionError | OSError):
        return True
    names = " ".join(cls.__name__.lower() for cls in type(exc).__mro__)
    return any(word in names for word in ("connect", "transport", "network", "protocolerror", "readerror"))


def normalize_exception(exc: BaseException, *, provider: str = "provider") -> errors.GengateError:
    """Any exception from a provider SDK or transport as a gengate error (message scrubbed)."""
    if isinstance(exc, errors.GengateError):
        exc.message = scrub(exc.message)
        return exc
    if _unparsable(exc):
        # aiohttp's message says what failed; its str() adds the URL (a key may be in a query)
        detail = getattr(exc, "message", None)
        return unreadable(provider, f"its answer could not be parsed ({detail or type(exc).__name__})")
    status = _status_of(exc)
    if status is not None and status >= 400:
        body = getattr(exc, "body", None)
        if body is None:
            body = getattr(exc, "message", None) or str(exc)
        error_type = getattr(exc, "type", None) or getattr(exc, "code", None)
        return from_status(
            status,
            body,
            headers=_headers_of(exc),
            provider=provider,
            error_type=error_type if isinstance(error_type, str) else None,
        )
    if isinstance(exc, UnreadableAnswer):
        return unreadable(provider, str(exc))
    if _is_timeout(exc):
        return errors.DeadlineExceeded(f"{provider} did not answer in time", reason=UPSTREAM_TIMEOUT)
    if any(cls.__name__ == "SSEError" for cls in type(exc).__mro__):  # httpx-sse: not an event stream
        return errors.Unavailable(
            f"{provider} did not answer with a server-sent-event stream ({scrub(str(exc))})",
            reason=UPSTREAM_PROTOCOL,
        )
    if _is_connection_error(exc):
        return errors.Unavailable(
            f"cannot reach {provider}: {scrub(str(exc)) or type(exc).__name__}", reason=UPSTREAM_UNAVAILABLE
        )
    return unreadable(provider, str(exc) or type(exc).__name__)


def unreadable(provider: str, why: str) -> errors.Unavailable:
    """The error for an upstream answer gengate could not read (retryable: the next may be fine)."""
    return errors.Unavailable(
        f"{provider} sent a response gengate could not read: {scrub(why)}", reason=UPSTREAM_BAD_RESPONSE
    )


def is_retryable(error: errors.GengateError) -> bool:
    """Whether another attempt may succeed: rate limits, unavailability, broken responses."""
    return isinstance(error, errors.ResourceExhausted | errors.Unavailable)
