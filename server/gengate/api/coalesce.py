"""Stream frames read ahead while the previous one is written, and deltas that queued up merged.

A gRPC stream pays a write (and, at the client, a read) per message: in grpc.aio each is a trip
through the C core's completion queue and its thread, ~70 µs a message on the 2-core machine
(`bench/README.md`). An upstream or an engine often has several deltas ready while one write is
in flight; sent as they came, each would wait for the one before it. `coalesced` reads the
events in a task of its own and hands the writer everything that arrived since its last write,
consecutive deltas of one generation merged into one. Nothing waits to be merged: a delta
that arrives while the writer is idle goes out at once, alone.

What the reader reads is what the stream produced: a stream that ends while its last frames
are still being written counts as finished (metrics, quotas, time to first token are the
source's), even if its caller hangs up before reading them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator

from gengate.backend import aclose_stream
from gengate.domain import GenerationDelta, StreamEvent, merge_deltas

# Events read ahead and not yet taken by the writer, at most: past this the reader waits (a
# slow client slows the source down, as when nothing read ahead). With what the writer took
# and is still writing, at most twice this many are held.
READ_AHEAD = 256
# A merged delta stops growing at this many characters (text, reasoning, tool-call arguments),
# far below a client's default 4 MiB message limit.
MERGE_CHARS = 64 * 1024


class _ReadAhead:
    """The events one reader task has read and the writer has not taken yet."""

    def __init__(self) -> None:
        self.events: deque[StreamEvent] = deque()
        self.finished = False
        self.closing = False  # the writer has gone: read nothing more
        self.error: BaseException | None = None
        self._writer: asyncio.Future[None] | None = None  # the writer waits here for events
        self._reader: asyncio.Future[None] | None = None  # the reader waits here for room

    async def read(self, source: AsyncIterator[StreamEvent]) -> None:
        try:
            async for event in source:
                self.events.append(event)
                self._wake_writer()
                if len(self.events) >= READ_AHEAD:
                    self._reader = asyncio.get_running_loop().create_future()
                    await self._reader
                if self.closing:
                    return
        except BaseException as exc:  # handed to the writer, which raises it after what came before
            self.error = exc
        finally:
            self.finished = True
            self._wake_writer()
            await aclose_stream(source)

    async def take(self) -> list[StreamEvent]:
        """Every event read since the last take (waiting for one); [] once the source ended."""
        while not self.events:
            if self.finished:
                return []
            self._writer = asyncio.get_running_loop().create_future()
            await self._writer
        taken = list(self.events)
        self.events.clear()
        self._wake_reader()
        return taken

    def close(self) -> None:
        """The writer is done: a reader waiting for room stops (it closes the source)."""
        self.closing = True
        self._wake_reader()

    def _wake_writer(self) -> None:
        if self._writer is not None and not self._writer.done():
            self._writer.set_result(None)

    def _wake_reader(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)


def merged(events: list[StreamEvent]) -> list[StreamEvent]:
    """`events` with each run of consecutive deltas of one generation merged into one delta
    (a run of more than MERGE_CHARS characters into several)."""
    out: list[StreamEvent] = []
    run: list[GenerationDelta] = []
    size = 0
    for event in events:
        if isinstance(event, GenerationDelta):
            chars = len(event.text) + len(event.reasoning) + sum(len(c.arguments) for c in event.tool_calls)
            if run and (run[0].index != event.index or size + chars > MERGE_CHARS):
                out.append(merge_deltas(run))
                run, size = [], 0
            run.append(event)
            size += chars
            continue
        if run:
            out.append(merge_deltas(run))
            run, size = [], 0
        out.append(event)
    if run:
        out.append(merge_deltas(run))
    return out


async def coalesced(source: AsyncIterator[StreamEvent]) -> AsyncGenerator[StreamEvent, None]:
    """`source`'s events in order, deltas that queued up during a write merged (see the module).
    An error of the source is raised after the events that came before it; closing this stream
    stops the reader and closes the source before it returns."""
    ahead = _ReadAhead()
    reader = asyncio.get_running_loop().create_task(ahead.read(source))
    try:
        while True:
            events = await ahead.take()
            if not events:
                break
            for event in merged(events) if len(events) > 1 else events:
                yield event
        if ahead.error is not None:
            raise ahead.error
    finally:
        ahead.close()
        if not reader.done():
            reader.cancel()
        # asyncio.wait, not `await reader`: a cancel of this task while the source closes is
        # this task's own, and must not be taken for the reader's.
        await asyncio.wait({reader})
        if not reader.cancelled():
            reader.result()  # an error closing the source
