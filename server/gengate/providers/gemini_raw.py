"""The raw path of the Gemini backend: `google-genai` builds and sends each generateContent and
streamGenerateContent request (its converters, auth, URL, API version, headers, timeout, and its
APIError family for a non-200 answer), gengate reads the answer's JSON and event stream itself,
bounded (providers.rawhttp), instead of the SDK building pydantic objects for every chunk.

Continuation: google-genai 3.x follows it above the request (`AsyncModels.
_generate_content_with_continuation`, `_extra_utils.StreamContinuation`), so it is done here the
same way. An answer whose first candidate has a `continuationToken` and no finish reason (or
CONTINUATION) is continued by the same request again with that `continuationToken`; unary, the
hops merge as `merge_continuation_responses` merges them (each candidate's parts in order, its
finish reason the last hop's, usage counts summed); streamed, chunks flow on across hops (the
first candidate's intermediate CONTINUATION dropped, each usage the earlier hops' plus its own),
and a stream that breaks after a checkpoint token resumes from it, as StreamContinuation does.
Unlike the SDK, at most MAX_HOPS hops are sent: a hostile upstream asking to continue forever
ends in an UPSTREAM_BAD_RESPONSE error, not a loop.

The SDK calls used are private (models._GenerateContentParameters_to_mldev / _to_vertex,
_common.convert_to_dict / encode_unserializable_types,
BaseApiClient._build_request / _async_request): google-genai's major version is pinned and
tests/providers/test_raw_sdks.py fails by name if one goes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import httpx
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from gengate.domain import FinishReason, Generation, Usage
from gengate.providers import gemini_wire as wire
from gengate.providers import rawhttp
from gengate.providers.base import (
    Chunk,
    ChunkEnd,
    ChunkText,
    ChunkUsage,
    Completion,
    check_event_stream,
    map_finish_reason,
)
from gengate.providers.errors import UnreadableAnswer

# The most requests one answer may take, continuation hops and stream resumptions together.
MAX_HOPS = 32
# Stream resumptions in a row that got no new checkpoint (the SDK's
# MAX_STREAM_RECONNECTS_WITHOUT_PROGRESS).
MAX_STALLS = 3
CONTINUATION = "CONTINUATION"

# Finish reasons of a failed function call: Gemini gives no call, and no answer either.
_CALL_FAILED = frozenset(
    {"MALFORMED_FUNCTION_CALL", "UNEXPECTED_TOOL_CALL", "TOO_MANY_TOOL_CALLS", "MISSING_THOUGHT_SIGNATURE"}
)


def finish(raw: str | None) -> FinishReason:
    """A candidate's finish reason; one that says its function call failed is ERROR (a call made
    stops with STOP, which settling turns into TOOL_CALLS), and a CONTINUATION left unfollowed
    (no token came with it) is LENGTH: the answer was cut short."""
    if raw in _CALL_FAILED:
        return FinishReason.ERROR
    if raw is not None and raw.upper() == CONTINUATION:
        return FinishReason.LENGTH
    return map_finish_reason(raw)


class BoundedClient(httpx.AsyncClient):
    """The httpx client the SDK sends with: a non-200 answer's body is read here, at most
    ERROR_BODY_BYTES (rawhttp.read_error), and handed on read, so the SDK's APIError never reads
    a body whole however long (one over the limit is UnreadableAnswer)."""

    async def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        response = await super().send(request, **kwargs)
        if response.status_code == 200:  # what the SDK's raise_for_async_response lets through
            return response
        read: httpx.Response = await rawhttp.read_error(response)
        return read


def hop_request(
    api: Any, request: Mapping[str, Any], *, stream: bool, token: bytes | None, timeout_s: float
) -> tuple[str, dict[str, Any], types.HttpOptions | None]:
    """One request's path, body and HTTP options as `AsyncModels._generate_content(_stream)`
    builds them (its converters), with `token` as its continuationToken."""
    from google.genai import _common
    from google.genai import models as sdk_models

    update: dict[str, Any] = {"http_options": types.HttpOptions(timeout=max(1, int(timeout_s * 1000)))}
    if token:
        update["continuation_token"] = token
    config = request["config"].model_copy(update=update)
    # The converters take the parameters as a dict too (its values the SDK's own types, already
    # validated): a quarter of the cost of their pydantic form, the body the same (a test holds it).
    params = {"model": request["model"], "contents": request["contents"], "config": dict(config)}
    if api.vertexai:
        body = sdk_models._GenerateContentParameters_to_vertex(api, params, None, params)
    else:
        body = sdk_models._GenerateContentParameters_to_mldev(api, params, None, params)
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    url = body.get("_url")
    path = f"{{model}}:{method}".format_map(url) if url else f"{{model}}:{method}"
    query = body.get("_query")
    if query:
        path = f"{path}?{urlencode(query)}"
    body.pop("config", None)
    return path, _common.encode_unserializable_types(_common.convert_to_dict(body)), config.http_options


async def open_hop(
    client: genai.Client, request: Mapping[str, Any], *, stream: bool, token: bytes | None, timeout_s: float
) -> httpx.Response:
    """One request of an answer sent by the SDK (hop_request; `_build_request` makes the URL and
    headers, `_async_request` sends it); the 200 response comes back unread (the caller closes
    it). A non-200 answer raises the SDK's APIError (ClientError, ServerError).

    gengate's clients have no SDK retries (providers.retry retries), so `_async_request` would
    send it once through tenacity (`stop_after_attempt(1)`, reraised); `_async_request_once`
    sends it the same without that (~4% of a unary call's CPU). A client with retry options
    still goes through them."""
    api = client.aio.models._api_client
    path, body, http_options = hop_request(api, request, stream=stream, token=token, timeout_s=timeout_s)
    http_request = api._build_request("post", path, body, http_options)
    if api._http_options.retry_options is None:
        answer = await api._async_request_once(http_request, True)
    else:
        answer = await api._async_request(http_request=http_request, http_options=http_options, stream=True)
    response = answer.response_stream
    if not isinstance(response, httpx.Response):  # only without gengate's BoundedClient
        raise TypeError(f"google-genai answered with a {type(response).__name__}, not an httpx response")
    return response


# --- usage --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Counts:
    """The token counts of usageMetadata gengate reads; None: not reported."""

    prompt: int | None = None
    candidates: int | None = None
    thoughts: int | None = None

    @classmethod
    def of(cls, answer: Any) -> Counts | None:
        meta = rawhttp.member(answer, "usageMetadata")
        if meta is None:
            return None
        return cls(
            rawhttp.integer(meta, "promptTokenCount"),
            rawhttp.integer(meta, "candidatesTokenCount"),
            rawhttp.integer(meta, "thoughtsTokenCount"),
        )

    def plus(self, later: Counts | None) -> Counts:
        """Two hops' counts together, as the SDK merges them: summed where both have one."""
        if later is None:
            return self
        return Counts(
            _sum(self.prompt, later.prompt),
            _sum(self.candidates, later.candidates),
            _sum(self.thoughts, later.thoughts),
        )

    def usage(self) -> Usage | None:
        """Prompt and output tokens; thinking counts as output (billed so, as other providers
        count it), though Gemini reports it apart (`thoughtsTokenCount`)."""
        if self.candidates is None:
            return None
        return Usage(self.prompt or 0, self.candidates + (self.thoughts or 0))


def _sum(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else a + b


def _plus(earlier: Counts | None, later: Counts | None) -> Counts | None:
    return later if earlier is None else earlier.plus(later)


# --- unary ----------------------------------------------------------------------------------------


def _resumable(reason: str | None) -> bool:
    """Whether a finish reason leaves the answer open to continue (none yet, or CONTINUATION)."""
    return reason is None or reason.upper() == CONTINUATION


def resume_token(answer: Any) -> bytes | None:
    """The token to continue a unary answer with (the SDK's should_continue_generation): the
    first candidate's continuationToken while its finish reason leaves it open."""
    candidates = rawhttp.objects(answer, "candidates")
    if not candidates:
        return None
    token = wire.b64_bytes(candidates[0], "continuationToken")
    return token if token and _resumable(rawhttp.optional_text(candidates[0], "finishReason")) else None


@dataclass
class _Turn:
    """One candidate position merged across hops: its parts, its last finish reason and index."""

    parts: wire.CandidateParts = field(default_factory=wire.CandidateParts)
    finish: str | None = None
    index: int | None = None

    def take(self, candidate: Any) -> None:
        self.parts.add(rawhttp.member(candidate, "content"))
        self.finish = rawhttp.optional_text(candidate, "finishReason")
        index = rawhttp.integer(candidate, "index")
        self.index = self.index if index is None else index

    def generation(self) -> Generation:
        return Generation(
            index=self.index or 0,
            text="".join(self.parts.text),
            finish_reason=finish(self.finish),
            tool_calls=tuple(self.parts.calls),
            reasoning=self.parts.reasoning(),
        )


class _Merged:
    """Unary hops merged as the SDK's merge_continuation_responses merges them: candidates by
    position (parts appended, finish reason the latest hop's, which an empty hop clears), usage
    counts summed."""

    def __init__(self) -> None:
        self.turns: list[_Turn] = []
        self.counts: Counts | None = None

    def add(self, answer: Mapping[str, Any]) -> None:
        candidates = rawhttp.objects(answer, "candidates")
        if self.turns and not candidates:
            for turn in self.turns:
                turn.finish = None
        for position, candidate in enumerate(candidates):
            if position == len(self.turns):
                self.turns.append(_Turn())
            self.turns[position].take(candidate)
        self.counts = _plus(self.counts, Counts.of(answer))

    def completion(self) -> Completion:
        generations = sorted((t.generation() for t in self.turns), key=lambda g: g.index)
        return Completion(generations, self.counts.usage() if self.counts is not None else None)


def _over_limit() -> UnreadableAnswer:
    return UnreadableAnswer(f"it asked to continue its answer past gengate's limit of {MAX_HOPS} requests")


class _Clock:
    """The time left of one answer's `timeout`, shared by all its hops."""

    def __init__(self, timeout: float) -> None:
        self.deadline = time.monotonic() + timeout

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the answer's continuation hops ran past its timeout")
        return left


async def complete(client: genai.Client, request: Mapping[str, Any], timeout: float) -> Completion:
    """A unary answer, its continuation hops followed and merged (module docstring), within
    `timeout` in all (as the SDK's aiohttp transport bounded a unary call in total, not each
    read of it)."""
    clock = _Clock(timeout)
    enabled = request["config"].automatic_continuation is not False
    merged = _Merged()
    token: bytes | None = None
    left = rawhttp.MAX_BODY_BYTES  # for all hops together: a merged answer holds them all
    async with asyncio.timeout(timeout):
        for hop in range(MAX_HOPS):
            response = await open_hop(client, request, stream=False, token=token, timeout_s=clock.left())
            try:
                body = await rawhttp.read_body(response, left)
            except UnreadableAnswer:
                if hop == 0:
                    raise
                raise UnreadableAnswer(
                    f"its answer, continued over {hop + 1} requests, is over gengate's limit of "
                    f"{rawhttp.MAX_BODY_BYTES} bytes in all"
                ) from None
            left -= len(body)
            answer = rawhttp.loads_object(body)
            merged.add(answer)
            token = resume_token(answer) if enabled else None
            if token is None:
                return merged.completion()
    raise _over_limit()


# --- streamed -------------------------------------------------------------------------------------


@dataclass
class _Hop:
    """What one request of a stream saw (the SDK's _StreamHop)."""

    start: bytes | None = None  # the token it was sent with
    token: bytes | None = None  # the latest checkpoint it got
    finish: str | None = None  # the first candidate's finish reason, if one came
    feedback: bool = False  # promptFeedback came (the prompt was judged: nothing to resume)
    content: bool = False  # the first candidate sent parts
    received: bool = False  # any chunk came
    usage: Counts | None = None  # the stream's usage so far: earlier hops' plus this one's latest


class StreamHops:
    """google-genai's StreamContinuation on raw chunks: `start` a hop (its token), `observe` each
    chunk, `end` it (with the error that ended it, if any): True when another hop should follow.
    Raises the hop's error when the stream cannot resume, UnreadableAnswer past MAX_HOPS."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.accumulated: Counts | None = None
        self.resume: bytes | None = None
        self.stalls = 0
        self.last_error: Exception | None = None
        self.hops = 0
        self.hop = _Hop()

    def start(self) -> bytes | None:
        if self.hops >= MAX_HOPS:
            raise _over_limit()
        self.hops += 1
        self.hop = _Hop(start=self.resume)
        return self.resume

    def _can_resume(self, token: bytes | None, reason: str | None, feedback: bool) -> bool:
        return bool(self.enabled and token and not feedback and _resumable(reason))

    def observe(self, chunk: Mapping[str, Any]) -> tuple[bool, Counts | None]:
        """Records a chunk; returns whether its first candidate's finish reason is to be dropped
        (the stream continues past it) and the usage to report (None: the chunk had none)."""
        hop = self.hop
        hop.received = True
        if rawhttp.member(chunk, "promptFeedback") is not None:
            hop.feedback = True
        cleared = False
        candidates = rawhttp.objects(chunk, "candidates")
        if candidates:
            first = candidates[0]
            content = rawhttp.member(first, "content")
            if content is not None and rawhttp.items(content, "parts"):
                hop.content = True
            reason = rawhttp.optional_text(first, "finishReason")
            if reason:
                hop.finish = reason
            token = wire.b64_bytes(first, "continuationToken")
            if token:
                hop.token = token
            elif reason and not _resumable(reason):
                hop.token = None
            cleared = bool(reason) and self._can_resume(hop.token, reason, False)
        counts = Counts.of(chunk)
        if counts is not None:
            counts = _plus(self.accumulated, counts)
            hop.usage = counts
        return cleared, counts

    def end(self, error: Exception | None) -> bool:
        hop = self.hop
        if hop.usage is not None:
            self.accumulated = hop.usage
        if isinstance(error, genai_errors.APIError) and not hop.received:
            raise error  # rejected before streaming: not resumed (the retry policy's to judge)
        progress = hop.content or bool(hop.token and hop.token != hop.start)
        if error is not None:
            self.last_error = error
        elif progress:
            self.last_error = None
        self.resume, self.stalls = self._next_token()
        if self._can_resume(self.resume, hop.finish, hop.feedback):
            return True
        if error is not None:
            raise error
        if hop.finish is None and not hop.feedback and self.last_error is not None:
            raise self.last_error
        return False

    def _next_token(self) -> tuple[bytes | None, int]:
        """The token to resume from (None: stop) and the stalls in a row so far."""
        hop = self.hop
        if hop.finish is not None or hop.feedback:
            ended = hop.finish is not None and hop.finish.upper() == CONTINUATION
            if ended and not hop.feedback and hop.token and hop.token != hop.start:
                return hop.token, 0
            return None, 0
        if hop.token and hop.token != hop.start:
            return hop.token, 0
        if hop.content or self.stalls >= MAX_STALLS:
            return None, self.stalls
        return hop.start, self.stalls + 1


async def _raise_stream_error(chunk: Mapping[str, Any], response: httpx.Response) -> None:
    """An error event mid-stream raised as the SDK's APIError for its code, as
    `async_request_streamed` raises it."""
    error = rawhttp.member(chunk, "error")
    code = rawhttp.integer(error, "code") if error is not None else None
    if code is None:
        raise UnreadableAnswer(f"its stream sent an error without a code: {str(chunk)[:500]}")
    await genai_errors.APIError.raise_error_async(code, dict(chunk), response)


async def stream(
    client: genai.Client, request: Mapping[str, Any], timeout: float, label: str
) -> AsyncIterator[Chunk]:
    """Text and thought text as they come, a function call whole (as Gemini sends it) as one
    fragment, each candidate's signature entries with its end; across continuation hops and
    resumptions (module docstring)."""
    clock = _Clock(timeout)
    hops = StreamHops(enabled=request["config"].automatic_continuation is not False)
    turns: dict[int, wire.CandidateParts] = {}
    while True:
        token = hops.start()
        left = clock.left()
        error: Exception | None = None
        try:
            response = await open_hop(client, request, stream=True, token=token, timeout_s=left)
            try:
                check_event_stream(label, response.headers.get("content-type"))
                async for event in rawhttp.events(response):
                    chunk = rawhttp.loads_object(event.data, "an event of its stream")
                    if "error" in chunk:
                        await _raise_stream_error(chunk, response)
                    cleared, counts = hops.observe(chunk)
                    for position, candidate in enumerate(rawhttp.objects(chunk, "candidates")):
                        index = rawhttp.integer(candidate, "index") or 0
                        got = turns.setdefault(index, wire.CandidateParts())
                        text, thought, calls = got.add(rawhttp.member(candidate, "content"))
                        if text or thought or calls:
                            yield ChunkText(index, text, tool_calls=calls, reasoning=thought)
                        reason = rawhttp.optional_text(candidate, "finishReason")
                        if reason is not None and not (position == 0 and cleared):
                            reasoning = got.reasoning()
                            signatures = reasoning.signatures if reasoning is not None else ()
                            yield ChunkEnd(index, finish(reason), reasoning_signatures=signatures)
                    usage = counts.usage() if counts is not None else None
                    if usage is not None:
                        yield ChunkUsage(usage.input_tokens, usage.output_tokens)
            finally:
                await response.aclose()
        except (httpx.TransportError, TimeoutError, genai_errors.APIError) as exc:
            # A failed transport, or an error the stream sent, may resume from a checkpoint (as
            # the SDK resumes). A chunk gengate cannot read may not: resuming from the token it
            # carried would skip its content without a word.
            error = exc
        if not hops.end(error):
            return
