"""Raw upstream answers for the SDK-backed providers: the SDK builds and sends the request (auth,
Azure routing, timeouts, status errors) and hands back the httpx response unread; gengate reads
the body itself (orjson) and parses server-sent events itself, both bounded, instead of the SDK
typing every answer and every stream chunk as pydantic objects.

The `text`/`integer`/`items`... accessors read one field of an answer whichever form it has (the
plain dict read here, or an SDK object where a batch or another SDK still hands one), and raise
UnreadableAnswer for a field of the wrong kind, so a malformed answer is UPSTREAM_BAD_RESPONSE.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gengate.providers.errors import UnreadableAnswer

# The most a unary answer's body may hold (decoded), and one event (or one line) of a stream.
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_EVENT_BYTES = 8 * 1024 * 1024
# The most an error answer's body may hold: a real one is a few hundred bytes, and the SDK parses
# it again (text, then JSON), several times its size in memory.
ERROR_BODY_BYTES = 1024 * 1024
# The OpenAI family's last event of a stream (its data), and how much of the body after it is
# read, for at most how long, so that the HTTP/1.1 connection is kept for the next request: a
# response closed unread drops its connection, and every stream would open (and, over TLS,
# handshake) a new one. After it comes only the chunked encoding's end, sent with it.
DONE = b"[DONE]"
DRAIN_BYTES = 64 * 1024
DRAIN_S = 0.1


class RawResponse(Protocol):
    """What is read of an httpx (or httpx2, the openai and anthropic SDKs') response."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


async def post(client: Any, path: str, body: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
    """POSTs `body` through a Stainless-generated SDK client (openai, anthropic: both on httpx2)
    and returns its httpx2 response unread (the caller closes it). The SDK raises its status
    error for a non-2xx answer before returning, its body read, so status mapping is unchanged."""
    import httpx2

    return await client.post(path, body=body, cast_to=httpx2.Response, stream=True, options=options)


def sdk_request(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An SDK method's keyword arguments as `post`'s body and request options: `extra_body`
    merged over the fields (as the SDK merges it), `timeout` and `extra_headers` as options."""
    body = dict(params)
    body.update(body.pop("extra_body", None) or {})
    options: dict[str, Any] = {}
    if "timeout" in body:
        options["timeout"] = body.pop("timeout")
    headers = body.pop("extra_headers", None)
    if headers:
        options["headers"] = headers
    return body, options


async def read_body(response: RawResponse, limit: int | None = None) -> bytes:
    """The whole (decoded) body, at most `limit` (MAX_BODY_BYTES) bytes; the response is closed after."""
    limit = MAX_BODY_BYTES if limit is None else limit
    try:
        length = response.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise UnreadableAnswer(f"its body of {int(length)} bytes is over gengate's limit of {limit}")
        buffer = bytearray()
        async for piece in response.aiter_bytes():
            buffer += piece
            if len(buffer) > limit:
                raise UnreadableAnswer(f"its body is over gengate's limit of {limit} bytes")
        return bytes(buffer)
    finally:
        await response.aclose()


async def read_error(response: Any) -> Any:
    """A non-2xx answer read whole, at most ERROR_BODY_BYTES (`read_error_body`), as a read
    response of the same (httpx or httpx2) class, for an SDK's error parsing to read as its own."""
    body = await read_error_body(response)
    # The body is decoded already: the copy must not say it is compressed, or how long it was.
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _BODY_HEADERS]
    extensions = {k: v for k, v in response.extensions.items() if k in _KEPT_EXTENSIONS}
    return type(response)(
        response.status_code, headers=headers, content=body, request=response.request, extensions=extensions
    )


async def read_error_body(response: RawResponse) -> bytes:
    """A non-2xx answer's body, at most ERROR_BODY_BYTES; the response is closed after."""
    return await read_body(response, ERROR_BODY_BYTES)


_BODY_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})
_KEPT_EXTENSIONS = frozenset({"http_version", "reason_phrase"})


def loads(data: bytes | str, what: str = "its body") -> Any:
    """`data` parsed as JSON (UnreadableAnswer when it is none)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UnreadableAnswer(f"{what} is no JSON ({exc})") from None


def loads_object(data: bytes | str, what: str = "its body") -> dict[str, Any]:
    """`data` parsed as a JSON object (UnreadableAnswer when it is no JSON, or not an object)."""
    value = loads(data, what)
    if not isinstance(value, dict):
        raise UnreadableAnswer(f"{what} is a JSON {_kind(value)}, not an object")
    return value


async def read_object(response: RawResponse, limit: int | None = None) -> dict[str, Any]:
    """A unary answer: its body, bounded, as a JSON object."""
    return loads_object(await read_body(response, limit))


@dataclass(frozen=True, slots=True)
class Event:
    """One server-sent event: its `event:` name (None: unnamed) and its data lines joined."""

    name: str | None
    data: bytes


async def events(
    response: RawResponse, limit: int | None = None, *, end: bytes | None = None
) -> AsyncIterator[Event]:
    """The stream's events (the WHATWG rules: LF, CRLF or CR line ends, `:` comments ignored,
    data lines joined by LF, an event without data not dispatched, an unfinished event at EOF
    dropped). A line or an event over `limit` bytes raises UnreadableAnswer, so memory stays
    bounded whatever the upstream sends (`limit`: MAX_EVENT_BYTES). An event whose data starts
    with `end` (DONE; spaces around it allowed) ends the stream unyielded, the rest of the body
    read (`_drain`) so its connection is reused. The caller closes the response."""
    limit = MAX_EVENT_BYTES if limit is None else limit
    pieces = response.aiter_bytes()
    # An unfinished line, grown in place: a long line in many small pieces costs its length once,
    # not once per piece.
    pending = bytearray()
    after_cr = False  # the last line ended in CR: an LF opening the next piece belongs to it
    data: list[bytes] = []
    size = 0
    name: str | None = None
    async for piece in pieces:
        if after_cr and piece.startswith(b"\n"):
            piece = piece[1:]
        if b"\n" not in piece and b"\r" not in piece:
            pending += piece
            after_cr = False
            if len(pending) > limit:
                raise UnreadableAnswer(f"a line of its event stream is over gengate's limit of {limit} bytes")
            continue
        if pending:
            pending += piece
            piece = bytes(pending)
            pending = bytearray()
        lines = piece.splitlines(keepends=True)
        if lines and not lines[-1].endswith((b"\n", b"\r")):
            pending = bytearray(lines.pop())
        after_cr = not pending and bool(lines) and lines[-1].endswith(b"\r")
        for raw in lines:
            line = raw.rstrip(b"\r\n")
            if not line:
                if data:
                    joined = b"\n".join(data)
                    if end is not None and joined[:32].strip().startswith(end):
                        await _drain(pieces)
                        return
                    yield Event(name, joined)
                data, size, name = [], 0, None
                continue
            field, _, value = line.partition(b":")
            if not field:
                continue  # a comment (a keep-alive)
            if value.startswith(b" "):
                value = value[1:]
            if field == b"data":
                size += len(value) + 1
                if size > limit:
                    raise UnreadableAnswer(f"an event of its stream is over gengate's limit of {limit} bytes")
                data.append(value)
            elif field == b"event":
                name = value.decode("utf-8", "replace")
            # id and retry mean nothing to a one-shot request; other fields are ignored by the rules
        if len(pending) > limit:
            raise UnreadableAnswer(f"a line of its event stream is over gengate's limit of {limit} bytes")


async def _drain(pieces: AsyncIterator[bytes]) -> None:
    """Reads what is left of a stream's body after its last event, at most DRAIN_BYTES for
    DRAIN_S; past either, or on a read error, the connection is left to be dropped when the
    response closes (the answer is whole already: nothing is lost but the connection)."""
    left = DRAIN_BYTES
    try:
        async with asyncio.timeout(DRAIN_S):
            async for piece in pieces:
                left -= len(piece)
                if left < 0:
                    return
    except Exception:  # TimeoutError, or the SDK's transport error (httpx or httpx2): drop it
        return


# --- fields of an answer, as a dict or as an SDK object -------------------------------------------


def field(obj: Any, name: str) -> Any:
    """`obj[name]` of a dict, or the attribute of an SDK object (None when absent)."""
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def text(obj: Any, name: str) -> str:
    """A text field ("" when absent or null)."""
    value = field(obj, name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UnreadableAnswer(f"`{name}` is a {_kind(value)}, not text")
    return value


def optional_text(obj: Any, name: str) -> str | None:
    """A text field that may be absent (None)."""
    value = field(obj, name)
    return None if value is None else text(obj, name)


def flag(obj: Any, name: str) -> bool | None:
    """A boolean field (None when absent or null)."""
    value = field(obj, name)
    if value is None or isinstance(value, bool):
        return value
    raise UnreadableAnswer(f"`{name}` is a {_kind(value)}, not a boolean")


def integer(obj: Any, name: str) -> int | None:
    """A whole-number field (None when absent or null)."""
    value = field(obj, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnreadableAnswer(f"`{name}` is a {_kind(value)}, not a whole number")
    return value


def number(obj: Any, name: str) -> float | None:
    """A numeric field (None when absent or null)."""
    value = field(obj, name)
    return None if value is None else as_number(value, name)


def as_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnreadableAnswer(f"`{name}` is a {_kind(value)}, not a number")
    return float(value)


def member(obj: Any, name: str) -> Any:
    """A nested object (a dict or an SDK object; None when absent or null)."""
    value = field(obj, name)
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str | bytes | int | float | list | tuple):
        raise UnreadableAnswer(f"`{name}` is a {_kind(value)}, not an object")
    return value


def items(obj: Any, name: str) -> list[Any] | tuple[Any, ...]:
    """A list field (empty when absent or null)."""
    value = field(obj, name)
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise UnreadableAnswer(f"`{name}` is a {_kind(value)}, not a list")
    return value


def objects(obj: Any, name: str) -> list[Any]:
    """A list field whose entries are all objects (dicts or SDK objects)."""
    out = list(items(obj, name))
    for entry in out:
        if entry is None or isinstance(entry, str | bytes | int | float | list | tuple):
            raise UnreadableAnswer(f"an entry of `{name}` is a {_kind(entry)}, not an object")
    return out


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
