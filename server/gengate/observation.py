"""What the server observes of its calls, apart from how it is exported (gengate.metrics).

Two observers, both optional (None: nothing is observed and nothing is paid for):

- a `RequestObserver` sees each caller request once, when it ends (the service core: a
  Generate, a stream, one BatchGenerate item, one batch-job item), as a `RequestOutcome`;
- a `RouteObserver` sees each routed call of a model (the router: a caller's call, a composite's
  member call), with the `CallNotes` the layers below wrote while it ran.

`CallNotes` is how the layers below the router say what happened inside a call (a provider
retried, a constraint compile hit the cache, a validated output was re-sampled) without knowing
who listens: the router makes the notes of a routed call current (a context variable) and the
layer that knows writes into `current_notes()` when there are any. Notes are plain data, so an
engine worker writes its own and sends them back with the call's end (gengate.workers.protocol).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from gengate.domain import GenerationRequest

T = TypeVar("T")

# How a validation retry was made (the `method` of gengate_validation_retries_total).
RESAMPLE = "resample"  # a local engine sampled the generation again with another seed
REASK = "reask"  # a provider was asked again with the validation error


@dataclass(slots=True)
class CallNotes:
    """What happened inside one routed call, below the router."""

    validation_retries: dict[str, int] = field(default_factory=dict)  # method -> tries made again
    compile_hits: int = 0  # constraint compiles answered from an engine's compile cache
    compile_misses: int = 0  # ... and compiled for this call
    compile_s: list[float] = field(default_factory=list)  # how long each compile of this call took
    provider_retries: dict[str, int] = field(default_factory=dict)  # error reason -> retries
    upstream: dict[str, int] = field(default_factory=dict)  # upstream answer (HTTP status, "ok") -> count

    def empty(self) -> bool:
        return not (
            self.validation_retries
            or self.compile_hits
            or self.compile_misses
            or self.provider_retries
            or self.upstream
        )

    def merge(self, other: CallNotes) -> None:
        """Adds `other`'s notes to these (a worker's notes of the same call)."""
        for mine, theirs in (
            (self.validation_retries, other.validation_retries),
            (self.provider_retries, other.provider_retries),
            (self.upstream, other.upstream),
        ):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count
        self.compile_hits += other.compile_hits
        self.compile_misses += other.compile_misses
        self.compile_s.extend(other.compile_s)


_current: ContextVar[CallNotes | None] = ContextVar("gengate_call_notes", default=None)


def current_notes() -> CallNotes | None:
    """The notes of the routed call running here, or None when nobody observes it."""
    return _current.get()


def set_notes(notes: CallNotes | None) -> Token[CallNotes | None]:
    """Makes `notes` current in this context (undo with `reset_notes`, in the same context)."""
    return _current.set(notes)


def reset_notes(token: Token[CallNotes | None]) -> None:
    _current.reset(token)


def count(table: dict[str, int], key: str) -> None:
    """One more `key` in a notes table."""
    table[key] = table.get(key, 0) + 1


def note_validation_retry(notes: CallNotes | None, method: str) -> None:
    if notes is not None:
        count(notes.validation_retries, method)


def note_compile(hit: bool, seconds: float | None = None) -> None:
    """A constraint compile of the current call: from the cache, or compiled in `seconds`."""
    notes = _current.get()
    if notes is None:
        return
    if hit:
        notes.compile_hits += 1
    else:
        notes.compile_misses += 1
        if seconds is not None:
            notes.compile_s.append(seconds)


def note_upstream(answer: str, retry_reason: str | None = None) -> None:
    """One upstream attempt of the current call: its answer ("ok", an HTTP status, or what went
    wrong without one) and, when another attempt follows, the reason it is retried."""
    notes = _current.get()
    if notes is None:
        return
    count(notes.upstream, answer)
    if retry_reason is not None:
        count(notes.provider_retries, retry_reason)


async def noted(stream: AsyncIterator[T], notes: CallNotes) -> AsyncIterator[T]:
    """`stream`, with `notes` current while each of its items is produced, never across a yield:
    a stream is closed wherever its consumer drops it, and a context variable set in one
    asyncio Context cannot be reset in another (as BackendSpan.events does with spans)."""
    while True:
        token = _current.set(notes)
        try:
            item = await anext(stream)
        except StopAsyncIteration:
            return
        finally:
            _current.reset(token)
        yield item


@dataclass(slots=True)  # not frozen: one is made per request, and frozen init costs 3x
class RequestOutcome:
    """One caller request as it ended."""

    operation: str  # generate | generate_stream | batch_generate | batch_job
    model: str  # the served model asked for; "" for a name that is not served
    caller: str
    code: str  # "OK" or the gRPC status code's name
    duration_s: float
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    time_to_first_token_s: float | None = None  # streams: arrival to the first text
    time_per_output_token_s: tuple[float, ...] = ()  # one per generation with two tokens or more
    constraint_kind: str | None = None  # the structured output's kind, if any
    enforcement: str | None = None  # how it was enforced (known: the result's; else declared)
    validation_failed: bool = False  # refused because an output did not validate


class RequestObserver(Protocol):
    """Sees every caller request once, as it ends."""

    def request_done(self, outcome: RequestOutcome) -> None: ...


class RouteObserver(Protocol):
    """Sees every routed call of a model once, as it ends, with what the layers below noted."""

    def routed(self, model: str, request: GenerationRequest, notes: CallNotes) -> None: ...
