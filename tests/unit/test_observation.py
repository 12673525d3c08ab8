"""gengate.observation's call notes: written where a call's context is current, nowhere else;
kept by the objects that outlive the context (Attempts); plain data across processes; and a
stream sets them only while it produces an item."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import AsyncIterator

from gengate.constraints.retries import VALIDATION_RETRIES, Attempts
from gengate.observation import (
    REASK,
    RESAMPLE,
    CallNotes,
    current_notes,
    note_compile,
    note_upstream,
    noted,
    reset_notes,
    set_notes,
)


def test_nothing_is_noted_when_no_call_is_observed() -> None:
    assert current_notes() is None
    note_compile(hit=True)
    note_upstream("ok", "UPSTREAM_RATE_LIMITED")
    attempts = Attempts()
    assert attempts.failed(0, "bad") is True  # the rule is the same, observed or not


def test_attempts_note_each_try_made_again_by_how_it_is_made() -> None:
    notes = CallNotes()
    token = set_notes(notes)
    try:
        engine = Attempts()  # a local engine's: re-sampled
        provider = Attempts(source="prov")  # a provider's: re-asked
    finally:
        reset_notes(token)
    # The tries run later, from wherever (an engine's scheduler task): the notes go with them.
    assert [engine.failed(0, "bad") for _ in range(1 + VALIDATION_RETRIES)][-1] is False
    provider.failed(0, "bad")
    provider.failed(1, "bad")
    assert notes.validation_retries == {RESAMPLE: VALIDATION_RETRIES, REASK: 2}


def test_notes_merge_and_cross_a_process_boundary_as_plain_data() -> None:
    worker = CallNotes()
    token = set_notes(worker)
    try:
        note_compile(hit=False, seconds=0.25)
        note_compile(hit=True)
        note_upstream("429", "UPSTREAM_RATE_LIMITED")
        note_upstream("ok")
    finally:
        reset_notes(token)
    assert not worker.empty() and CallNotes().empty()
    server = CallNotes()
    server.add_compile(hit=True)
    server.add_upstream("ok")
    server.add_upstream("ok")
    server.merge(pickle.loads(pickle.dumps(worker)))
    assert (server.compile_hits, server.compile_misses, tuple(server.compile_s)) == (2, 1, (0.25,))
    assert server.upstream == {"ok": 3, "429": 1}
    assert server.provider_retries == {"UPSTREAM_RATE_LIMITED": 1}


async def test_a_noted_stream_sets_its_notes_only_while_an_item_is_made() -> None:
    notes = CallNotes()
    seen: list[CallNotes | None] = []

    async def produce() -> AsyncIterator[int]:
        for i in range(3):
            seen.append(current_notes())
            note_compile(hit=True)
            yield i

    items = []
    async for item in noted(produce(), notes):
        items.append(item)
        assert current_notes() is None  # the consumer's own context, between items
    assert items == [0, 1, 2] and seen == [notes] * 3 and notes.compile_hits == 3

    # Dropped half-way and closed from another task: nothing to undo there, no context error.
    stream = noted(produce(), notes)
    await anext(stream)
    await asyncio.create_task(stream.aclose())  # type: ignore[attr-defined]
