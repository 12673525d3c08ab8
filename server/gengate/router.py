"""Model name → backend, with per-model concurrency limits and a bounded queue. A call through a
route (`Route.generate`, `Route.generate_stream`) is the one way anything calls a model: the
service for callers, composites for their members."""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gengate.backend import Backend, Composite, aclose_stream
from gengate.callers.context import current_priority
from gengate.config import ModelConfig, ServerConfig
from gengate.deadline import iterate_within_deadline, within_deadline
from gengate.domain import (
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    ModelCapabilities,
    ModelInfo,
    StreamEvent,
    evolve,
)
from gengate.errors import ECHO_CHARS, ConfigError, InvalidArgument, NotFound, ResourceExhausted, echo
from gengate.observation import CallNotes, RouteObserver, noted, reset_notes, set_notes
from gengate.telemetry import backend_span

log = logging.getLogger(__name__)


class Slots:
    """A model's concurrency slots: interactive calls by caller priority, background after them.

    A freed slot goes to the waiting interactive call of highest effective priority (its
    caller's priority plus one point per `aging_s` seconds it has waited, so low priority still
    progresses under a stream of higher-priority calls; arrival order among equals), and only
    then to a background one (a batch job's item): background callers never take a slot while
    an interactive call waits. While interactive calls run, and for `quiet_s` after the last
    one, background work holds at most `busy_background` slots, and `idle_background`
    otherwise: engines queue or batch what they are given, so a long line of job items in the
    engine would be paid for by the next interactive call. Background items run FIFO.
    """

    __slots__ = (
        "_background", "_clock", "_free", "_interactive", "_quiet_at", "_seq", "_timer", "aging_s",
        "background_active", "busy_background", "idle_background", "interactive_active", "quiet_s",
    )  # fmt: skip

    def __init__(
        self,
        count: int,
        *,
        quiet_s: float = 1.0,
        busy_background: int = 1,
        idle_background: int | None = None,
        aging_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._free = count
        self.idle_background = count if idle_background is None else idle_background
        # A heap of [key, arrival number, waiter, bounded]: the smallest key is served first.
        self._interactive: list[list[Any]] = []
        self._background: deque[asyncio.Future[None]] = deque()
        self._seq = 0
        self._clock = clock
        self.aging_s = aging_s
        self.quiet_s = quiet_s
        self.busy_background = busy_background
        self._quiet_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.interactive_active = 0
        self.background_active = 0

    def _key(self, priority: int) -> float:
        """A waiter's place: all waiters age at the same rate, so "priority + waited / aging_s"
        orders them as "arrival / aging_s - priority" does, a key fixed at arrival."""
        return self._clock() / self.aging_s - priority

    def _background_may_start(self) -> bool:
        if self._free <= 0 or self._interactive:
            return False
        busy = self.interactive_active > 0 or time.monotonic() < self._quiet_at
        return self.background_active < (self.busy_background if busy else self.idle_background)

    async def acquire(self, *, background: bool = False, priority: int = 0, bounded: bool = True) -> None:
        """Waits for a slot. `priority`: the caller's (interactive calls); `bounded`: the waiter
        may be displaced by a higher-priority call when the queue is full (`displace`)."""
        if background:
            if not self._background and self._background_may_start():
                self._free -= 1
                self.background_active += 1
                return
            await self._wait_background()
            return
        if self._free > 0 and not self._interactive:
            self._free -= 1
            self.interactive_active += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq += 1
        entry = [self._key(priority), self._seq, waiter, bounded]
        heapq.heappush(self._interactive, entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot just as the caller left
            else:
                self._remove(entry)
            raise

    async def _wait_background(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._background.append(waiter)
        self._wake_when_quiet()  # arriving in a quiet period: nothing else would wake it at its end
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(background=True)
            else:
                self._background.remove(waiter)
            raise

    def _remove(self, entry: list[Any]) -> None:
        try:
            self._interactive.remove(entry)
        except ValueError:
            return
        heapq.heapify(self._interactive)

    def displace(self, priority: int, error: BaseException) -> bool:
        """Makes room in a full queue for a call of `priority`: the bounded waiter of lowest
        effective priority, if lower than this call's, leaves the queue with `error`. False when
        no waiter ranks below the call (it is the one refused)."""
        key = self._key(priority)
        lowest = max((e for e in self._interactive if e[3]), default=None, key=lambda e: (e[0], e[1]))
        if lowest is None or lowest[0] <= key:
            return False
        self._remove(lowest)
        waiter: asyncio.Future[None] = lowest[2]
        if not waiter.done():
            waiter.set_exception(error)
        return True

    def release(self, *, background: bool = False) -> None:
        self._free += 1
        if background:
            self.background_active -= 1
        else:
            self.interactive_active -= 1
            if self.interactive_active == 0:
                self._quiet_at = time.monotonic() + self.quiet_s
                if self._background and self._timer is None:
                    loop = asyncio.get_running_loop()
                    self._timer = loop.call_later(self.quiet_s, self._quiet)
        self._dispatch()

    def _quiet(self) -> None:
        self._timer = None
        self._dispatch()

    def _dispatch(self) -> None:
        """Hands free slots to waiters: interactive first, then background as far as allowed."""
        while self._free > 0 and self._interactive:
            waiter = heapq.heappop(self._interactive)[2]
            if not waiter.done():
                self._free -= 1
                self.interactive_active += 1
                waiter.set_result(None)
        while self._background and self._background_may_start():
            background = self._background.popleft()
            if not background.done():
                self._free -= 1
                self.background_active += 1
                background.set_result(None)
        self._wake_when_quiet()

    def _wake_when_quiet(self) -> None:
        """Background work waits for the quiet period's end: a timer dispatches it then."""
        if self._background and self._timer is None and time.monotonic() < self._quiet_at:
            delay = self._quiet_at - time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(delay, self._quiet)


@dataclass
class Route:
    """A served model: its backend and the limits around it."""

    config: ModelConfig
    backend: Backend
    slots: Slots | asyncio.Semaphore
    waiting: int = 0  # interactive calls queued (what max_queue bounds)
    background_waiting: int = 0
    in_flight: int = 0
    served: int = 0
    started: bool = False
    start_error: str | None = field(default=None)
    # Sees each routed call as it ends, with what the layers below noted (metrics); None: no one.
    observer: RouteObserver | None = None

    @property
    def name(self) -> str:
        return self.config.name

    def slot(self, *, bounded: bool = True, background: bool = False) -> RouteSlot:
        """Holds one concurrency slot (`async with route.slot() as queued_s`); yields the seconds
        spent queueing for it.

        `bounded=False` waits even when the queue is full: for callers that bound their own
        demand (a batch holds at most max_concurrency items of a model in flight).
        `background=True` (batch jobs) yields every slot to interactive calls and is not counted
        against max_queue.
        """
        return RouteSlot(self, bounded, background)

    async def generate(
        self, request: GenerationRequest, *, bounded: bool = True, background: bool = False
    ) -> GenerationResult:
        """One routed call: a concurrency slot, a backend span and the request's deadline; the
        time spent queueing for the slot is in the result's timings."""
        observer = self.observer
        notes = None if observer is None else CallNotes()
        token = set_notes(notes) if notes is not None else None
        try:
            with backend_span(self.name, self.config.backend, request) as span:
                async with self.slot(bounded=bounded, background=background) as queued_s:
                    result = await within_deadline(self.backend.generate(request), request)
                span.record_result(result)
        finally:
            if token is not None:
                reset_notes(token)
            if observer is not None and notes is not None and notes.noted:  # most calls note nothing
                observer.routed(self.config.name, request, notes)
        return evolve(result, timings=result.timings.later(queued_s, queued=True))

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """One routed stream: as `generate`, each event awaited under the deadline, each end's
        timings counting the time queued."""
        observer = self.observer
        notes = None if observer is None else CallNotes()
        try:
            with backend_span(self.name, self.config.backend, request, current=False) as span:
                async with self.slot() as queued_s:
                    stream = self.backend.generate_stream(request)
                    events = stream if notes is None else noted(stream, notes)
                    try:
                        async for event in iterate_within_deadline(span.events(events), request):
                            if isinstance(event, GenerationEnd):
                                span.record_end(event)
                                event = evolve(event, timings=event.timings.later(queued_s, queued=True))
                            yield event
                    finally:
                        await aclose_stream(events)
                        if events is not stream:
                            await aclose_stream(stream)
        finally:
            if observer is not None and notes is not None and notes.noted:
                observer.routed(self.config.name, request, notes)


class RouteSlot:
    """The async context manager behind Route.slot (a class: cheaper per request than
    contextlib.asynccontextmanager's generator)."""

    __slots__ = ("_background", "_bounded", "_route")

    def __init__(self, route: Route, bounded: bool, background: bool = False) -> None:
        self._route = route
        self._bounded = bounded
        self._background = background

    async def __aenter__(self) -> float:
        route = self._route
        if self._background:
            queued_at = time.monotonic()
            route.background_waiting += 1
            try:
                assert isinstance(route.slots, Slots), "background calls need the router's Slots"
                await route.slots.acquire(background=True)
            finally:
                route.background_waiting -= 1
            route.in_flight += 1
            return time.monotonic() - queued_at
        slots = route.slots
        if not isinstance(slots, Slots):  # a plain semaphore (tests, embedding code): no queue order
            if self._bounded and route.waiting >= route.config.max_queue:
                raise _queue_full(route)
            route.waiting += 1
            queued_at = time.monotonic()
            try:
                await slots.acquire()
            finally:
                route.waiting -= 1
            route.in_flight += 1
            return time.monotonic() - queued_at
        max_queue = route.config.max_queue
        priority = current_priority()
        if self._bounded and route.waiting >= max_queue:
            if not slots.displace(priority, _queue_full(route, displaced=True)):
                raise _queue_full(route)
        queued_at = time.monotonic()
        route.waiting += 1
        try:
            await slots.acquire(priority=priority, bounded=self._bounded)
        finally:
            route.waiting -= 1
        route.in_flight += 1
        return time.monotonic() - queued_at

    async def __aexit__(self, *exc_info: object) -> None:
        route = self._route
        route.in_flight -= 1
        route.served += 1
        if self._background:
            assert isinstance(route.slots, Slots)
            route.slots.release(background=True)
        else:
            route.slots.release()


def _queue_full(route: Route, *, displaced: bool = False) -> ResourceExhausted:
    max_queue = route.config.max_queue
    why = ": a call of higher priority took this one's place" if displaced else ""
    return ResourceExhausted(
        f"model {route.name!r} has {route.waiting} requests queued (max_queue {max_queue}){why}",
        reason="QUEUE_FULL",
        retry_after_s=1.0,
    )


class MemberBackend:
    """The handle a composite gets on a member model: calls go through the member's route, so
    its max_concurrency and max_queue bind composites too (a full queue is RESOURCE_EXHAUSTED,
    which a fallback moves past) and each gets its own span under the composite's."""

    def __init__(self, route: Route) -> None:
        self._route = route
        self.name = route.name
        self.kind = route.config.backend

    @property
    def capabilities(self) -> ModelCapabilities:
        """The member's current capabilities (engines settle theirs when they load)."""
        return self._route.backend.capabilities

    @capabilities.setter
    def capabilities(self, value: ModelCapabilities) -> None:
        raise AttributeError("a member's capabilities belong to the member")

    async def start(self) -> None:
        """The router starts the member itself."""

    async def aclose(self) -> None:
        """The router closes the member itself."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self._route.generate(request)

    def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        return self._route.generate_stream(request)


BackendFactory = Callable[[ModelConfig], Backend]


def build_backend(config: ModelConfig) -> Backend:
    """Instantiates the configured backend (cheap; loading happens in start()): local engines in
    worker processes pinned to their GPUs, unless `isolation: inline` (gengate.workers.factory)."""
    from gengate.workers.factory import build_backend as build_local_or_inline

    return build_local_or_inline(config)


class Router:
    """Owns every served backend; looks them up by name."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self._routes = {r.name: r for r in routes}
        # Composite models (backends with `bind`), each after the composites it is built from.
        self._composites = self._bind_composites()

    @classmethod
    def from_config(
        cls,
        config: ServerConfig,
        factory: BackendFactory = build_backend,
        *,
        observer: RouteObserver | None = None,
    ) -> Router:
        return cls([Route(m, factory(m), Slots(m.max_concurrency), observer=observer) for m in config.models])

    def serves(self, model: str) -> bool:
        return model in self._routes

    @property
    def routes(self) -> list[Route]:
        return list(self._routes.values())

    def route(self, model: str) -> Route:
        if not model:
            raise InvalidArgument.field("model", "is required: name a served model (see ListModels)")
        route = self._routes.get(model)
        if route is None:
            known = ", ".join(sorted(self._routes)) or "none"
            raise NotFound(
                f"model {echo(model)} is not served here (served: {known})",
                reason="MODEL_NOT_FOUND",
                metadata={"model": model[:ECHO_CHARS]},
            )
        return route

    def _bind_composites(self) -> list[str]:
        """Hands every composite a lookup of its members (members first); ConfigError naming the
        composite for a member that is not configured, or for composites that form a cycle."""
        bound: list[str] = []
        binding: list[str] = []

        def bind(route: Route) -> None:
            if route.name in bound:
                return
            if route.name in binding:
                cycle = " -> ".join([*binding[binding.index(route.name) :], route.name])
                raise ConfigError(f"composite models form a cycle: {cycle}")
            binding.append(route.name)

            def lookup(name: str) -> Backend:
                member = self._routes.get(name)
                if member is None:
                    known = ", ".join(sorted(self._routes))
                    raise ConfigError(
                        f"model {route.name!r} ({route.config.backend}): member {name!r} is not a "
                        f"configured model (configured: {known})"
                    )
                if isinstance(member.backend, Composite):
                    bind(member)
                return MemberBackend(member)

            assert isinstance(route.backend, Composite)
            route.backend.bind(lookup)
            binding.pop()
            bound.append(route.name)

        for route in self._routes.values():
            if isinstance(route.backend, Composite):
                bind(route)
        return bound

    def concurrency_of(self, model: str) -> int | None:
        """The model's max_concurrency, or None for a name that is not served."""
        route = self._routes.get(model)
        return None if route is None else route.config.max_concurrency

    def models(self) -> list[ModelInfo]:
        return [
            ModelInfo(name=r.name, backend=r.config.backend, capabilities=r.backend.capabilities)
            for r in self._routes.values()
        ]

    async def start_all(self) -> None:
        """Starts every backend concurrently; any failure stops the server start with its reason."""

        async def start(route: Route) -> None:
            began = time.monotonic()
            await route.backend.start()
            route.started = True
            log.info(
                "model %s (%s) ready in %.1fs", route.name, route.config.backend, time.monotonic() - began
            )

        composites = set(self._composites)
        await asyncio.gather(*(start(r) for r in self._routes.values() if r.name not in composites))
        for name in self._composites:  # after their members: their capabilities derive from them
            await start(self._routes[name])

    async def close_all(self) -> None:
        for route in self._routes.values():
            try:
                await route.backend.aclose()
            except Exception:
                log.exception("closing model %s failed", route.name)
