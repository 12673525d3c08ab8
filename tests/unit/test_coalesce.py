"""coalesced(): a stream's events read ahead while a frame is written; deltas that queued merged.

Every event arrives, in order; what queued during a write goes out merged (text, tokens,
logprobs, tool-call fragments and reasoning kept in order); a delta that comes while the writer
waits goes alone; an error comes after the events before it; closing the stream stops and
closes the source; the read-ahead is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from gengate.api import coalesce
from gengate.api.coalesce import coalesced, merged
from gengate.domain import (
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    StreamEvent,
    StreamStart,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    merge_deltas,
)
from gengate.errors import Unavailable

START = StreamStart("r", "m", 3)


def delta(index: int, text: str, **kw: object) -> GenerationDelta:
    return GenerationDelta(index, text, **kw)  # type: ignore[arg-type]


def end(index: int) -> GenerationEnd:
    return GenerationEnd(index, FinishReason.STOP, Usage(3, 1))


async def burst(events: list[StreamEvent]) -> AsyncIterator[StreamEvent]:
    """All events at once: nothing awaited between them."""
    for event in events:
        yield event


async def spaced(events: list[StreamEvent], gap_s: float) -> AsyncIterator[StreamEvent]:
    for event in events:
        await asyncio.sleep(gap_s)
        yield event


async def slow_writer(stream: AsyncIterator[StreamEvent], write_s: float = 0.01) -> list[StreamEvent]:
    out = []
    async for event in stream:
        out.append(event)
        await asyncio.sleep(write_s)  # a write in flight: what comes meanwhile queues
    return out


async def test_deltas_that_queue_during_a_write_go_out_merged() -> None:
    lp = [TokenLogprob(f"t{i}", -0.5, token_id=i) for i in range(3)]
    calls = [ToolCallDelta(0, id="c1", name="f", arguments='{"a"'), ToolCallDelta(0, arguments=": 1}")]
    events: list[StreamEvent] = [
        START,
        delta(0, "Hel", logprobs=(lp[0],)),
        delta(0, "lo", logprobs=(lp[1],), reasoning="hm"),
        delta(0, "", tool_calls=(calls[0],), token_count=2),
        delta(0, "!", logprobs=(lp[2],), tool_calls=(calls[1],), reasoning=" ok"),
        end(0),
    ]
    out = await slow_writer(coalesced(burst(events)))
    assert out[0] is START
    assert out[-1] == end(0)
    deltas = [e for e in out if isinstance(e, GenerationDelta)]
    assert len(deltas) == 1  # all four were ready before the first frame was written
    assert deltas[0] == GenerationDelta(0, "Hello!", 5, tuple(lp), tuple(calls), "hm ok")


async def test_a_delta_arriving_while_the_writer_waits_goes_alone() -> None:
    events: list[StreamEvent] = [START, *(delta(0, w) for w in "abcde"), end(0)]
    out = [e async for e in coalesced(spaced(events, 0.01))]
    assert out == events


async def test_generations_are_merged_each_on_its_own_and_ends_stay_in_place() -> None:
    events: list[StreamEvent] = [
        START, delta(0, "a"), delta(0, "b"), delta(1, "x"), delta(1, "y"), end(1), delta(0, "c"), end(0),
    ]  # fmt: skip
    expected = [
        START,
        delta(0, "ab", token_count=2),
        delta(1, "xy", token_count=2),
        end(1),
        delta(0, "c"),
        end(0),
    ]
    assert merged(events) == expected
    assert await slow_writer(coalesced(burst(events))) == expected


async def test_an_error_comes_after_the_events_before_it() -> None:
    async def failing() -> AsyncIterator[StreamEvent]:
        yield START
        yield delta(0, "a")
        yield delta(0, "b")
        raise Unavailable("upstream went away", reason="UPSTREAM_GONE")

    out: list[StreamEvent] = []
    with pytest.raises(Unavailable, match="upstream went away"):
        async for event in coalesced(failing()):
            out.append(event)
            await asyncio.sleep(0.01)
    assert "".join(e.text for e in out if isinstance(e, GenerationDelta)) == "ab"


async def test_closing_the_stream_stops_the_reader_and_closes_the_source() -> None:
    closed = asyncio.Event()
    produced = 0

    async def endless() -> AsyncIterator[StreamEvent]:
        nonlocal produced
        try:
            yield START
            while True:
                await asyncio.sleep(0.001)
                produced += 1
                yield delta(0, "x")
        finally:
            closed.set()

    stream = coalesced(endless())
    assert await anext(stream) is START
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert closed.is_set()
    before = produced
    await asyncio.sleep(0.02)
    assert produced == before  # nothing reads on


async def test_the_read_ahead_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coalesce, "READ_AHEAD", 8)
    produced = 0

    async def many() -> AsyncIterator[StreamEvent]:
        nonlocal produced
        yield START
        for _ in range(100):
            produced += 1
            yield delta(0, "x")
            await asyncio.sleep(0)

    stream = coalesced(many())
    assert await anext(stream) is START
    await asyncio.sleep(0.05)  # the writer is stuck: the reader stops at the bound
    assert produced <= 8 + 2  # the bound, and what the first take held
    rest = [e async for e in stream]
    assert sum(e.token_count for e in rest if isinstance(e, GenerationDelta)) == 100


def test_merge_deltas_of_one_is_itself() -> None:
    one = delta(0, "a")
    assert merge_deltas([one]) is one
    assert merge_deltas([delta(0, "a"), delta(0, "b")]).logprobs is None


def test_a_merged_delta_stops_growing_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coalesce, "MERGE_CHARS", 10)
    events: list[StreamEvent] = [delta(0, "abcd") for _ in range(6)]
    out = merged(events)
    assert [d.text for d in out if isinstance(d, GenerationDelta)] == ["abcdabcd", "abcdabcd", "abcdabcd"]


async def test_closing_stops_a_reader_waiting_for_room_and_closes_its_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(coalesce, "READ_AHEAD", 4)
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[StreamEvent]:
        try:
            yield START
            while True:
                yield delta(0, "x")
        finally:
            closed.set()

    stream = coalesced(endless())
    assert await anext(stream) is START
    await asyncio.sleep(0.01)  # the reader fills the read-ahead and waits for room
    await asyncio.wait_for(stream.aclose(), 2)  # type: ignore[attr-defined]
    assert closed.is_set()
