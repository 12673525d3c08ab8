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

from collections.abc import AsyncIterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, TypeVar

from gengate.domain import GenerationRequest

T = TypeVar("T")

# How a validation retry was made (the `method` of gengate_validation_retries_total).
RESAMPLE = "resample"  # a local engine sampled the generation again with another seed
REASK = "reask"  # a provider was asked again with the validation error


class CallNotes:
    """What happened inside one routed call, below the router.

    One is made for every observed call and most calls note nothing, so making one costs no
    table: the tables are the shared empty defaults below until a first write (always through
    these methods, which replace them) and `noted` says whether anything was written. (A
    dataclass with four default factories cost 4x as many instructions per call; callgrind.)
    """

    noted = False  # something was written: the observer has something to count
    compile_hits = 0  # constraint compiles answered from an engine's compile cache
    compile_misses = 0  # ... and compiled for this call
    # Read-only until the first write: the defaults are shared by every instance.
    validation_retries: Mapping[str, int] = MappingProxyType({})  # method -> tries made again
    compile_s: Sequence[float] = ()  # how long each compile of this call took
    provider_retries: Mapping[str, int] = MappingProxyType({})  # error reason -> retries
    upstream: Mapping[str, int] = MappingProxyType({})  # upstream answer (HTTP status, "ok") -> count

    def empty(self) -> bool:
        return not self.noted

    def add_validation_retry(self, method: str, count: int = 1) -> None:
        self.validation_retries = _added(self.validation_retries, method, count)
        self.noted = True

    def add_compile(self, hit: bool, seconds: float | None = None, count: int = 1) -> None:
        if hit:
            self.compile_hits += count
        else:
            self.compile_misses += count
            if seconds is not None:
                self.compile_s = (*self.compile_s, seconds)
        self.noted = True

    def add_upstream(self, answer: str, retry_reason: str | None = None) -> None:
        self.upstream = _added(self.upstream, answer, 1)
        if retry_reason is not None:
            self.provider_retries = _added(self.provider_retries, retry_reason, 1)
        self.noted = True

    def merge(self, other: CallNotes) -> None:
        """Adds `other`'s notes to these (a worker's notes of the same call)."""
        if not other.noted:
            return
        for method, count in other.validation_retries.items():
            self.validation_retries = _added(self.validation_retries, method, count)
        for reason, count in other.provider_retries.items():
            self.provider_retries = _added(self.provider_retries, reason, count)
        for answer, count in other.upstream.items():
            self.upstream = _added(self.upstream, answer, count)
        self.compile_hits += other.compile_hits
        self.compile_misses += other.compile_misses
        self.compile_s = (*self.compile_s, *other.compile_s)
        self.noted = True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CallNotes) and _fields(self) == _fields(other)

    def __repr__(self) -> str:
        return f"CallNotes{_fields(self)!r}"


def _added(table: Mapping[str, int], key: str, count: int) -> dict[str, int]:
    """`table` with `count` more `key`: a dict of this instance's own (the default is shared)."""
    mine = table if isinstance(table, dict) else dict(table)
    mine[key] = mine.get(key, 0) + count
    return mine


def _fields(notes: CallNotes) -> tuple[object, ...]:
    return (
        dict(notes.validation_retries), notes.compile_hits, notes.compile_misses, list(notes.compile_s),
        dict(notes.provider_retries), dict(notes.upstream),
    )  # fmt: skip


_current: ContextVar[CallNotes | None] = ContextVar("gengate_call_notes", default=None)

# The context variable's own methods, not wrappers: called on every observed call, and a Python
# frame costs more than the lookup (~430 instructions each; callgrind).
current_notes = _current.get  # the notes of the routed call running here, or None when nobody observes it
set_notes = _current.set  # makes notes current in this context (undo with reset_notes, in the same one)
reset_notes = _current.reset


def note_validation_retry(notes: CallNotes | None, method: str) -> None:
    if notes is not None:
        notes.add_validation_retry(method)


def note_compile(hit: bool, seconds: float | None = None) -> None:
    """A constraint compile of the current call: from the cache, or compiled in `seconds`."""
    notes = _current.get()
    if notes is not None:
        notes.add_compile(hit, seconds)


def note_upstream(answer: str, retry_reason: str | None = None) -> None:
    """One upstream attempt of the current call: its answer ("ok", an HTTP status, or what went
    wrong without one) and, when another attempt follows, the reason it is retried."""
    notes = _current.get()
    if notes is not None:
        notes.add_upstream(answer, retry_reason)


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

    def succeeded(
        self,
        operation: str,
        model: str,
        caller: str,
        duration_s: float,
        input_tokens: int,
        output_tokens: int,
        cached_input_tokens: int,
        time_per_output_token_s: tuple[float, ...],
        constraint_kind: str | None,
        enforcement: str | None,
        time_to_first_token_s: float | None = None,
    ) -> None:
        """`request_done` of a request that succeeded (code OK), its outcome's fields passed as
        they are: the common case, so no RequestOutcome is built for it."""


class RouteObserver(Protocol):
    """Sees every routed call of a model once, as it ends, with what the layers below noted."""

    def routed(self, model: str, request: GenerationRequest, notes: CallNotes) -> None: ...
