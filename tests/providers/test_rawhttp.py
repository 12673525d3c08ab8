"""providers.rawhttp: gengate reads the SDKs' raw responses itself, bounded. The SSE parser and
the body reader over real HTTP (httpx2 against a loopback server) and over every split of a
stream into pieces; then the OpenAI, Anthropic and Cohere backends, driven through their real SDKs
against the fakes, answering malformed, oversized, truncated and oddly framed upstreams with
precise errors (UPSTREAM_BAD_RESPONSE, UPSTREAM_PROTOCOL) and serving the next call as usual."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest

pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[openai])")
pytest.importorskip("anthropic", reason="the anthropic SDK is not installed (extra: gengate[anthropic])")

import contract_checks as cc
import httpx2
from fake_anthropic import API_KEY as ANTHROPIC_KEY
from fake_anthropic import FakeAnthropic
from fake_openai import API_KEY as OPENAI_KEY
from fake_openai import FakeOpenAI
from fakehttp import FakeServer, Fault, Json, Raw, Recorded
from gengate import errors
from gengate.domain import FinishReason, GenerationDelta, GenerationEnd
from gengate.providers import rawhttp
from gengate.providers.anthropic import AnthropicBackend
from gengate.providers.errors import UPSTREAM_BAD_RESPONSE, UPSTREAM_PROTOCOL, UnreadableAnswer
from gengate.providers.openai import OpenAIBackend

# --- the parser and the reader ------------------------------------------------------------------


class Pieces:
    """A body arriving in the given pieces (the shape rawhttp reads of an httpx response)."""

    def __init__(self, *pieces: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.pieces = pieces
        self.headers = dict(headers or {})
        self.closed = False

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece

    async def aclose(self) -> None:
        self.closed = True


async def parse(*pieces: bytes, limit: int | None = None) -> list[tuple[str | None, bytes]]:
    return [(e.name, e.data) async for e in rawhttp.events(Pieces(*pieces), limit)]


STREAM = (
    b": keep-alive\r\n\r\n"
    b"event: first\r\ndata: one\r\ndata:two\r\n\r\n"
    b'id: 7\rretry: 100\rdata: {"a":\r'
    b"data: 1}\r\r"
    b"data\n\n"  # a field without a colon: an empty data line (an event of "")
    b"event: named-but-empty\n\n"  # no data: not dispatched
    b":comment\ndata: last\n\n"
    b"data: unfinished"  # EOF before the blank line: dropped
)
EXPECTED = [("first", b"one\ntwo"), (None, b'{"a":\n1}'), (None, b""), (None, b"last")]


async def test_sse_framing_crlf_cr_lf_multiline_data_and_comments() -> None:
    assert await parse(STREAM) == EXPECTED
    assert json.loads(EXPECTED[1][1]) == {"a": 1}  # data lines joined by LF: JSON split over lines


async def test_sse_framing_holds_at_every_split_point() -> None:
    """However the network cuts the stream (inside a CRLF, a field name, a data line), the events
    are the same."""
    for at in range(1, len(STREAM)):
        assert await parse(STREAM[:at], STREAM[at:]) == EXPECTED, at
    assert await parse(*(STREAM[i : i + 1] for i in range(len(STREAM)))) == EXPECTED


async def test_an_sse_line_or_event_over_the_limit_is_unreadable() -> None:
    with pytest.raises(UnreadableAnswer, match="a line of its event stream is over"):
        await parse(b"data: " + b"x" * 600, b"x" * 600, limit=1000)  # no line end yet: bounded
    with pytest.raises(UnreadableAnswer, match="an event of its stream is over"):
        await parse(b"data: 0123456789\n" * 200 + b"\n", limit=1000)  # short lines, one huge event
    assert await parse(b"data: " + b"x" * 900 + b"\n\n", limit=1000) == [(None, b"x" * 900)]


async def test_a_long_line_in_many_small_pieces_reads_whole() -> None:
    """A line that trickles in (a slow or hostile upstream) is gathered in place: the same event,
    and the limit still counts the whole line."""
    line = b"data: " + b"y" * 200_000
    pieces = [line[i : i + 7] for i in range(0, len(line), 7)]
    assert await parse(*pieces, b"\r", b"\n\r\n") == [(None, b"y" * 200_000)]
    with pytest.raises(UnreadableAnswer, match="a line of its event stream is over"):
        await parse(*pieces, limit=100_000)


class Counted(Pieces):
    """Pieces that count how many were read, and can stall or fail after the last one."""

    def __init__(self, *pieces: bytes, then: str = "end") -> None:
        super().__init__(*pieces)
        self.read = 0
        self.then = then

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            self.read += 1
            yield piece
        if self.then == "stall":
            await asyncio.Event().wait()  # an upstream that keeps the response open, silent
        elif self.then == "fail":
            raise httpx2.ReadError("connection reset")


async def _until_done(response: Pieces) -> list[bytes]:
    return [e.data async for e in rawhttp.events(response, end=rawhttp.DONE)]


async def test_the_done_event_ends_a_stream_and_what_follows_it_is_read() -> None:
    """The events before [DONE] are the stream; it is not yielded, and the body after it is
    read to its end (so the HTTP/1.1 connection goes back to the pool), events and all."""
    body = Counted(b"data: one\n\n", b"data:  [DONE] \n\n", b"data: after\n\n", b"\r\n")
    assert await _until_done(body) == [b"one"]
    assert body.read == 4
    assert [e.data async for e in rawhttp.events(Pieces(b"data: [DONE]\n\n"))] == [b"[DONE]"]  # no `end`


async def test_what_follows_done_is_read_only_so_far() -> None:
    """Past DRAIN_BYTES after [DONE], or a silent upstream for DRAIN_S, or a read error: the
    stream ends as it is (the answer is whole), and the rest is left unread."""
    flood = Counted(b"data: one\n\ndata: [DONE]\n\n", *[b"x" * 4096] * 64)
    assert await _until_done(flood) == [b"one"]
    assert flood.read == 1 + rawhttp.DRAIN_BYTES // 4096 + 1
    stalled = Counted(b"data: one\n\ndata: [DONE]\n\n", then="stall")
    assert await asyncio.wait_for(_until_done(stalled), 30) == [b"one"]
    failing = Counted(b"data: one\n\ndata: [DONE]\n\n", then="fail")
    assert await _until_done(failing) == [b"one"]


async def test_a_body_over_the_limit_or_not_a_json_object_is_unreadable() -> None:
    with pytest.raises(UnreadableAnswer, match="over gengate's limit of 100 bytes"):
        await rawhttp.read_object(Pieces(b"{" + b" " * 60, b" " * 60 + b"}"), 100)  # no content-length
    declared = Pieces(b"{}", headers={"content-length": "5000"})
    with pytest.raises(UnreadableAnswer, match="5000 bytes is over"):
        await rawhttp.read_object(declared, 100)
    assert declared.closed
    with pytest.raises(UnreadableAnswer, match="is no JSON"):
        await rawhttp.read_object(Pieces(b'{"not": "what you expected'))
    with pytest.raises(UnreadableAnswer, match="a JSON list, not an object"):
        await rawhttp.read_object(Pieces(b"[1, 2]"))
    assert await rawhttp.read_object(Pieces(b'{"a": [1, ', b'"\xc3\xa9"]}')) == {"a": [1, "é"]}


@pytest.fixture(scope="module")
def raw_server() -> Iterator[tuple[FakeServer, list[Raw]]]:
    """A loopback server answering GET /raw with the queued bytes."""
    replies: list[Raw] = []
    server = FakeServer(auth=lambda rec: True, unauthorized=lambda: Json({}, 401))

    def answer(rec: Recorded) -> Raw:
        return replies.pop(0)

    server.add_route("GET", "/raw", answer)
    server.start()
    yield server, replies
    server.stop()


async def test_real_http_responses_are_read_bounded(raw_server: tuple[FakeServer, list[Raw]]) -> None:
    server, replies = raw_server
    replies.append(Raw(STREAM, "text/event-stream"))
    replies.append(Raw(b'{"ok": true}', "application/json"))
    replies.append(Raw(b'{"big": "' + b"x" * 5000 + b'"}', "application/json"))
    async with httpx2.AsyncClient() as client:
        async with client.stream("GET", server.base_url + "/raw") as response:
            got = [(e.name, e.data) async for e in rawhttp.events(response)]
        assert got == EXPECTED
        async with client.stream("GET", server.base_url + "/raw") as response:
            assert await rawhttp.read_object(response) == {"ok": True}
        async with client.stream("GET", server.base_url + "/raw") as response:
            with pytest.raises(UnreadableAnswer, match="over gengate's limit"):
                await rawhttp.read_object(response, 1000)


# --- OpenAI through its SDK -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_fake() -> Iterator[FakeOpenAI]:
    yield from cc.serving(FakeOpenAI())


@pytest.fixture
async def openai_make(openai_fake: FakeOpenAI) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        OpenAIBackend,
        "gpt",
        openai_fake,
        model="gpt-test",
        base_url=openai_fake.server.base_url + "/v1",
        api_key=OPENAI_KEY,
        max_retries=0,
    ) as build:
        yield build


def completion(**choice: Any) -> dict[str, Any]:
    """A chat completion with one choice: a good one, its fields replaced by `choice`."""
    good: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": "hi"},
        "finish_reason": "stop",
        "logprobs": None,
    }
    return {"id": "x", "object": "chat.completion", "choices": [good | choice]}


def sse(*events: Any, done: bool = True) -> str:
    """Chat-completion chunks (objects, or raw data text) as an event stream body."""
    frames = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(frames) + ("data: [DONE]\n\n" if done else "")


def chunk(content: str | None = None, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    d = delta | ({"content": content} if content is not None else {})
    return {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": d, "finish_reason": finish}],
    }


def answer_with(server: FakeServer, body: Any, content_type: str = "application/json") -> None:
    text = body if isinstance(body, str) else json.dumps(body)
    server.fail_next(Fault(status=200, body=text, content_type=content_type))


MALFORMED_COMPLETIONS = {
    "no JSON": ('{"choices": [', "is no JSON"),
    "choices not a list": ({"choices": {"0": {}}}, "`choices` is a object, not a list"),
    "a choice not an object": ({"choices": ["hi"]}, "an entry of `choices` is a string"),
    "content a number": (completion(message={"content": 7}), "`content` is a number, not text"),
    "message a list": (completion(message=["hi"]), "`message` is a list"),
    "tool_calls an object": (completion(message={"content": None, "tool_calls": {"id": 1}}), "`tool_calls`"),
    "tool call name a number": (
        completion(message={"tool_calls": [{"id": "c", "type": "function", "function": {"name": 5}}]}),
        "`name` is a number",
    ),
    "logprob token a number": (
        completion(logprobs={"content": [{"token": 1, "logprob": -0.1, "top_logprobs": []}]}),
        "`token` is a number",
    ),
    "logprob not a number": (
        completion(logprobs={"content": [{"token": "a", "logprob": "low", "top_logprobs": []}]}),
        "`logprob` is a string",
    ),
    "usage tokens text": ({**completion(), "usage": {"prompt_tokens": "3"}}, "`prompt_tokens` is a string"),
    "finish reason a number": (completion(finish_reason=3), "`finish_reason` is a number"),
}


@pytest.mark.parametrize("case", list(MALFORMED_COMPLETIONS), ids=str)
async def test_a_malformed_openai_answer_is_unreadable_and_the_next_call_works(
    case: str, openai_make: cc.Make, openai_fake: FakeOpenAI
) -> None:
    body, why = MALFORMED_COMPLETIONS[case]
    backend = await openai_make()
    answer_with(openai_fake.server, body)
    with pytest.raises(errors.Unavailable) as info:
        await backend.generate(cc.prompt(logprobs=1))
    assert info.value.reason == UPSTREAM_BAD_RESPONSE
    assert "OpenAI sent a response gengate could not read" in info.value.message
    assert why in info.value.message
    openai_fake.answers.append("fine again")
    assert (await backend.generate(cc.prompt())).generations[0].text == "fine again"


async def test_an_openai_body_over_the_limit_is_unreadable(
    openai_make: cc.Make, openai_fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rawhttp, "MAX_BODY_BYTES", 300)
    backend = await openai_make()
    openai_fake.answers.append("x " * 400)
    with pytest.raises(errors.Unavailable) as info:
        await backend.generate(cc.prompt())
    assert info.value.reason == UPSTREAM_BAD_RESPONSE and "over gengate's limit of 300" in info.value.message
    openai_fake.answers.append("short")
    assert (await backend.generate(cc.prompt())).generations[0].text == "short"


async def test_an_openai_stream_framed_with_crlf_comments_and_split_data_reads_whole(
    openai_make: cc.Make, openai_fake: FakeOpenAI
) -> None:
    split = json.dumps(chunk(" world")).replace('"choices":', '"choices":\ndata: ')
    body = (
        ": keep-alive\r\n\r\n"
        + sse(chunk("Hello"), done=False).replace("\n", "\r\n")
        + ": ping\n\n"
        + f"data: {split}\n\n"
        + "event: other\ndata: {}\n\n"  # not a chunk: skipped, as the SDK's stream has no choices for it
        + sse(
            chunk(finish="stop"),
            {"id": "x", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
        )
    )
    answer_with(openai_fake.server, body, "text/event-stream")
    backend = await openai_make()
    events = await cc.collect(backend.generate_stream(cc.prompt()))
    assert "".join(e.text for e in events if isinstance(e, GenerationDelta)) == "Hello world"
    end = next(e for e in events if isinstance(e, GenerationEnd))
    assert end.finish_reason == FinishReason.STOP
    assert (end.usage.input_tokens, end.usage.output_tokens) == (4, 2)


async def test_openai_stream_faults_are_precise_errors(
    openai_make: cc.Make, openai_fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = await openai_make()
    server = openai_fake.server

    async def fails(body: str) -> errors.GengateError:
        answer_with(server, body, "text/event-stream")
        with pytest.raises(errors.GengateError) as info:
            await cc.collect(backend.generate_stream(cc.prompt()))
        return info.value

    # A first event gengate cannot read: no event stream at all (the retry policy may try again).
    error = await fails(sse("{not json"))
    assert isinstance(error, errors.Unavailable) and error.reason == UPSTREAM_PROTOCOL
    # A bad event after good ones: the stream breaks with the reason.
    error = await fails(sse(chunk("a"), chunk(content=None, tool_calls="x")))
    assert error.reason == UPSTREAM_BAD_RESPONSE and "`tool_calls` is a string" in error.message
    # An error event mid-stream: its message, as the SDK's stream raised it.
    error = await fails(sse(chunk("a"), {"error": {"message": "the model fell over"}}))
    assert error.reason == UPSTREAM_BAD_RESPONSE and "the model fell over" in error.message
    # Truncated: the stream ends (cleanly) before any finish reason.
    error = await fails(sse(chunk("a"), chunk("b"), done=False))
    assert error.reason == UPSTREAM_PROTOCOL and "without a finish reason" in error.message
    # A line over the event limit, without a line end: refused before it is all in memory.
    monkeypatch.setattr(rawhttp, "MAX_EVENT_BYTES", 2000)
    error = await fails(sse(chunk("a"), done=False) + "data: " + "x" * 5000)
    assert error.reason == UPSTREAM_BAD_RESPONSE and "over gengate's limit of 2000" in error.message, (
        error.message
    )
    openai_fake.answers.append("still here")
    events = await cc.collect(backend.generate_stream(cc.prompt()))
    assert "".join(e.text for e in events if isinstance(e, GenerationDelta)) == "still here"


async def test_openai_status_errors_are_mapped_for_unary_and_stream(
    openai_make: cc.Make, openai_fake: FakeOpenAI
) -> None:
    """The SDK still raises its status error for a non-2xx answer, streamed or not."""
    backend = await openai_make()
    body = {"error": {"message": "slow down", "type": "rate_limit_error"}}
    for call in (backend.generate(cc.prompt()), cc.collect(backend.generate_stream(cc.prompt()))):
        openai_fake.server.fail_next(Fault(status=429, body=body, headers={"retry-after": "7"}))
        with pytest.raises(errors.ResourceExhausted) as info:
            await call
        assert "slow down" in info.value.message and info.value.retry_after_s == 7.0
    openai_fake.server.fail_next(Fault(status=400, body={"error": {"message": "bad field"}}))
    with pytest.raises(errors.InvalidArgument, match="bad field"):
        await cc.collect(backend.generate_stream(cc.prompt()))


# --- Anthropic through its SDK --------------------------------------------------------------------


@pytest.fixture(scope="module")
def anthropic_fake() -> Iterator[FakeAnthropic]:
    yield from cc.serving(FakeAnthropic())


@pytest.fixture
async def anthropic_make(anthropic_fake: FakeAnthropic) -> AsyncIterator[cc.Make]:
    async with cc.backends(
        AnthropicBackend,
        "claude",
        anthropic_fake,
        model="claude-test",
        base_url=anthropic_fake.server.base_url,
        api_key=ANTHROPIC_KEY,
        max_retries=0,
    ) as build:
        yield build


def message(**fields: Any) -> dict[str, Any]:
    good: dict[str, Any] = {
        "id": "msg",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }
    return good | fields


MALFORMED_MESSAGES = {
    "content an object": (message(content={"type": "text"}), "`content` is a object, not a list"),
    "a block not an object": (message(content=["hi"]), "an entry of `content` is a string"),
    "text a number": (message(content=[{"type": "text", "text": 4}]), "`text` is a number"),
    "tool_use name a list": (
        message(content=[{"type": "tool_use", "id": "t", "name": ["f"], "input": {}}]),
        "`name` is a list",
    ),
    "usage a string": (message(usage="lots"), "`usage` is a string"),
    "output tokens text": (message(usage={"input_tokens": 1, "output_tokens": "1"}), "`output_tokens`"),
}


@pytest.mark.parametrize("case", list(MALFORMED_MESSAGES), ids=str)
async def test_a_malformed_anthropic_message_is_unreadable_and_the_next_call_works(
    case: str, anthropic_make: cc.Make, anthropic_fake: FakeAnthropic
) -> None:
    body, why = MALFORMED_MESSAGES[case]
    backend = await anthropic_make()
    answer_with(anthropic_fake.server, body)
    with pytest.raises(errors.Unavailable) as info:
        await backend.generate(cc.prompt())
    assert info.value.reason == UPSTREAM_BAD_RESPONSE and why in info.value.message
    anthropic_fake.answers.append("fine again")
    assert (await backend.generate(cc.prompt())).generations[0].text == "fine again"


def anthropic_sse(*events: tuple[str, Any]) -> str:
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)


START = (
    "message_start",
    {"type": "message_start", "message": message(content=[], usage={"input_tokens": 5})},
)
OPEN = (
    "content_block_start",
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
)


def text_delta(text: Any, **extra: Any) -> tuple[str, Any]:
    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
    return "content_block_delta", delta | extra


END = (
    "message_delta",
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
)


async def test_anthropic_stream_reads_and_faults(
    anthropic_make: cc.Make, anthropic_fake: FakeAnthropic
) -> None:
    backend = await anthropic_make()
    server = anthropic_fake.server
    good = anthropic_sse(START, ("ping", {"type": "ping"}), OPEN, text_delta("Hi"), text_delta(" you"), END)
    answer_with(server, ": comment\r\n\r\n" + good.replace("\n", "\r\n"), "text/event-stream")
    events = await cc.collect(backend.generate_stream(cc.prompt()))
    assert "".join(e.text for e in events if isinstance(e, GenerationDelta)) == "Hi you"
    end = next(e for e in events if isinstance(e, GenerationEnd))
    assert (end.usage.input_tokens, end.usage.output_tokens) == (5, 2)

    async def fails(body: str) -> errors.GengateError:
        answer_with(server, body, "text/event-stream")
        with pytest.raises(errors.GengateError) as info:
            await cc.collect(backend.generate_stream(cc.prompt()))
        return info.value

    error = await fails(anthropic_sse(START, OPEN, text_delta("a"), text_delta(9)))
    assert error.reason == UPSTREAM_BAD_RESPONSE and "`text` is a number" in error.message
    no_index = (
        "content_block_delta",
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "a"}},
    )
    error = await fails(anthropic_sse(START, OPEN, text_delta("a"), no_index))
    assert error.reason == UPSTREAM_BAD_RESPONSE and "no `index`" in error.message
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    error = await fails(anthropic_sse(START, OPEN, text_delta("a"), ("error", overloaded)))
    assert isinstance(error, errors.Unavailable) and "Overloaded" in error.message
    error = await fails(anthropic_sse(START, OPEN, text_delta("a")))
    assert error.reason == UPSTREAM_PROTOCOL and "without a finish reason" in error.message
    anthropic_fake.server.fail_next(Fault(status=429, body={"type": "error", "error": {"message": "slow"}}))
    with pytest.raises(errors.ResourceExhausted, match="slow"):
        await cc.collect(backend.generate_stream(cc.prompt()))


# --- Cohere through its SDK's HTTP client ---------------------------------------------------------


@pytest.fixture(scope="module")
def cohere_fake() -> Iterator[Any]:
    pytest.importorskip("cohere", reason="the cohere SDK is not installed (extra: gengate[cohere])")
    from fake_cohere import FakeCohere

    yield from cc.serving(FakeCohere())


@pytest.fixture
async def cohere_make(cohere_fake: Any) -> AsyncIterator[cc.Make]:
    from fake_cohere import API_KEY
    from gengate.providers.cohere import CohereBackend

    async with cc.backends(
        CohereBackend,
        "command",
        cohere_fake,
        model="command-test",
        base_url=cohere_fake.server.base_url,
        api_key=API_KEY,
        max_retries=0,
    ) as build:
        yield build


def cohere_answer(**fields: Any) -> dict[str, Any]:
    good: dict[str, Any] = {
        "id": "c",
        "finish_reason": "COMPLETE",
        "message": {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
        "usage": {"billed_units": {"input_tokens": 2.0, "output_tokens": 1.0}},
    }
    return good | fields


MALFORMED_COHERE = {
    "content an object": (cohere_answer(message={"content": {"type": "text"}}), "`content` is a object"),
    "text a number": (
        cohere_answer(message={"content": [{"type": "text", "text": 1}]}),
        "`text` is a number",
    ),
    "tool call function a list": (
        cohere_answer(message={"tool_calls": [{"id": "t", "function": []}]}),
        "`function`",
    ),
    "usage counts text": (
        cohere_answer(usage={"tokens": {"input_tokens": 1, "output_tokens": "2"}}),
        "`output_tokens` is a string",
    ),
    "logprobs an object": (cohere_answer(logprobs={"text": "hi"}), "`logprobs` is a object"),
}


@pytest.mark.parametrize("case", list(MALFORMED_COHERE), ids=str)
async def test_a_malformed_cohere_answer_is_unreadable_and_the_next_call_works(
    case: str, cohere_make: cc.Make, cohere_fake: Any
) -> None:
    body, why = MALFORMED_COHERE[case]
    backend = await cohere_make()
    answer_with(cohere_fake.server, body)
    with pytest.raises(errors.Unavailable) as info:
        await backend.generate(cc.prompt())
    assert info.value.reason == UPSTREAM_BAD_RESPONSE and why in info.value.message
    cohere_fake.answers.append("fine again")
    assert (await backend.generate(cc.prompt())).generations[0].text == "fine again"


async def test_cohere_stream_faults_and_status_errors(cohere_make: cc.Make, cohere_fake: Any) -> None:
    backend = await cohere_make()
    server = cohere_fake.server

    def events(*items: dict[str, Any]) -> str:
        return "".join(f"event: {e['type']}\r\ndata: {json.dumps(e)}\r\n\r\n" for e in items)

    text = {"type": "content-delta", "index": 0, "delta": {"message": {"content": {"text": "Hey"}}}}
    end = {
        "type": "message-end",
        "delta": {"finish_reason": "COMPLETE", "usage": {"tokens": {"output_tokens": 1}}},
    }
    answer_with(server, ": keep-alive\r\n\r\n" + events(text, end), "text/event-stream")
    got = await cc.collect(backend.generate_stream(cc.prompt()))
    assert "".join(e.text for e in got if isinstance(e, GenerationDelta)) == "Hey"
    assert next(e for e in got if isinstance(e, GenerationEnd)).usage.output_tokens == 1

    bad = {"type": "content-delta", "index": 0, "delta": {"message": {"content": {"text": ["x"]}}}}
    answer_with(server, events(text, bad, end), "text/event-stream")
    with pytest.raises(errors.Unavailable) as info:
        await cc.collect(backend.generate_stream(cc.prompt()))
    assert info.value.reason == UPSTREAM_BAD_RESPONSE and "`text` is a list" in info.value.message
    answer_with(server, '{"not": "a stream"}')  # JSON where events were asked for
    with pytest.raises(errors.Unavailable) as info:
        await cc.collect(backend.generate_stream(cc.prompt()))
    assert info.value.reason == UPSTREAM_PROTOCOL
    # Status errors: the SDK's ApiError, rebuilt from the status, maps as the SDK's own did.
    server.fail_next(Fault(status=429, body={"message": "slow down"}, headers={"retry-after": "3"}))
    with pytest.raises(errors.ResourceExhausted) as limited:
        await cc.collect(backend.generate_stream(cc.prompt()))
    assert "slow down" in limited.value.message and limited.value.retry_after_s == 3.0
    server.fail_next(Fault(status=503, body="<html>down</html>", content_type="text/html"))
    with pytest.raises(errors.Unavailable, match="down"):
        await backend.generate(cc.prompt())
