"""Caller quotas: requests and tokens per minute (sliding windows) and calls at once.

A request is admitted when its caller's last minute has room for one more request and its
token window is not spent yet; tokens are charged when usage is known (input + output), so a
call that is admitted may take its window past the limit, and the next one waits for the
window to slide. Windows live in a `LimitState`: in this process by default, in Redis for
replicas that share one quota (callers/shared.py). Calls at once are counted in this process,
and, where the state is shared, also where every replica sees them (a lease per call in Redis):
one max_concurrency then holds across replicas.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gengate.callers.identity import Caller
from gengate.errors import ResourceExhausted

WINDOW_S = 60
# The window slides in steps of one second: a charge leaves it whole seconds after it was made.
STEP_S = 1
STEPS = WINDOW_S // STEP_S
# A caller over its max_concurrency learns nothing better than "soon".
CONCURRENCY_RETRY_S = 1.0
# A batch item waiting for room under a max_concurrency filled by other replicas asks again
# after this long, doubling up to the most.
HOLD_RETRY_FIRST_S = 0.05
HOLD_RETRY_MAX_S = 0.5


class SlidingWindow:
    """Amounts charged over the last WINDOW_S seconds, in STEP_S buckets."""

    __slots__ = ("_buckets", "_newest", "_until", "total")

    def __init__(self) -> None:
        self._buckets: deque[list[int]] = deque()  # [step, amount], oldest first
        self.total = 0
        # The newest bucket and when its step ends: an add before then touches nothing else
        # (nothing expires within a step), the common case of every call.
        self._newest: list[int] = [0, 0]
        self._until = -math.inf

    def _expire(self, step: int) -> None:
        buckets = self._buckets
        while buckets and buckets[0][0] <= step - STEPS:
            self.total -= buckets.popleft()[1]

    def used(self, now: float) -> int:
        self._expire(int(now // STEP_S))
        return self.total

    def add(self, now: float, amount: int) -> None:
        if now < self._until:
            self._newest[1] += amount
            self.total += amount
            return
        step = int(now // STEP_S)
        buckets = self._buckets
        if buckets and buckets[0][0] <= step - STEPS:
            self._expire(step)
        if buckets and buckets[-1][0] == step:
            buckets[-1][1] += amount
        else:
            buckets.append([step, amount])
        self.total += amount
        self._newest = buckets[-1]
        self._until = float((step + 1) * STEP_S)

    def wait_s(self, now: float, limit: int, cost: int) -> float:
        """Seconds until `cost` more fits under `limit` (0 when it fits now)."""
        if self.total + cost <= limit:  # fits even before expiring anything: the common case
            return 0.0
        excess = self.used(now) + cost - limit
        if excess <= 0:
            return 0.0
        for step, amount in self._buckets:
            excess -= amount
            if excess <= 0:
                return max((step + STEPS) * STEP_S - now, 0.0)
        return float(WINDOW_S)  # cost alone is over the limit: a full window, and it still will not fit


@dataclass(frozen=True)
class Refusal:
    """Why a caller's request was refused, and when to come back."""

    limit: str  # "requests_per_minute" | "tokens_per_minute"
    quota: int
    retry_after_s: float


class CallHold(Protocol):
    """One call counted in flight where the state keeps calls (a shared lease)."""

    def release(self) -> None:
        """The call ended (also on error or cancel): it counts no longer. A second release does nothing."""
        ...


class _InThisProcess:
    """A call counted only by this process's own gate (Admission's semaphore)."""

    def release(self) -> None:
        return None


IN_THIS_PROCESS: CallHold = _InThisProcess()


class LimitState(Protocol):
    """Where the per-minute windows (and the calls in flight beyond this process) live: one
    process, or shared by replicas."""

    async def admit(
        self, caller: str, requests_per_minute: int | None, tokens_per_minute: int | None
    ) -> Refusal | None:
        """Charges one request to `caller` when both windows have room (tokens: not spent yet);
        else charges nothing and says which limit refused, and for how long."""
        ...

    async def charge_tokens(self, caller: str, tokens: int) -> None:
        """Adds `tokens` to the caller's token window (usage, once known)."""
        ...

    async def hold_call(self, caller: str, max_concurrency: int) -> CallHold | None:
        """Counts one more call of `caller` in flight when fewer than `max_concurrency` are;
        None (nothing held) when that many are. Called with this process's own gate held."""
        ...

    async def admit_and_hold(
        self,
        caller: str,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
        max_concurrency: int,
    ) -> Refusal | CallHold | None:
        """`hold_call` and then `admit` in one step (one Redis round trip): the hold, or the
        windows' Refusal (nothing held or charged), or None when max_concurrency calls are held."""
        ...

    def status(self) -> str:
        """One line for logs and health: where the windows are and whether that works."""
        ...

    async def aclose(self) -> None: ...


class CallerWindows:
    """One caller's two windows in this process: requests and tokens."""

    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests = SlidingWindow()
        self.tokens = SlidingWindow()


class LocalLimits:
    """The windows in this process's memory."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._windows: dict[str, CallerWindows] = {}

    def windows(self, caller: str) -> CallerWindows:
        """`caller`'s windows (Admission keeps them with the caller's gate: one lookup a call)."""
        windows = self._windows.get(caller)
        if windows is None:
            windows = self._windows[caller] = CallerWindows()
        return windows

    def admit_now(
        self, caller: str, requests_per_minute: int | None, tokens_per_minute: int | None
    ) -> Refusal | None:
        return self.admit_windows(self.windows(caller), requests_per_minute, tokens_per_minute)

    def admit_windows(
        self, windows: CallerWindows, requests_per_minute: int | None, tokens_per_minute: int | None
    ) -> Refusal | None:
        """`admit` of one caller's windows, without awaiting: charges one request when both have
        room, else charges nothing and says which limit refused."""
        now = self.clock()
        # `window.total + 1 <= limit` is wait_s's own first test, made here: the common case
        # (room in the window) costs no call.
        if tokens_per_minute is not None:
            window = windows.tokens
            if window.total + 1 > tokens_per_minute:
                wait = window.wait_s(now, tokens_per_minute, 1)
                if wait > 0:
                    return Refusal("tokens_per_minute", tokens_per_minute, wait)
        if requests_per_minute is not None:
            window = windows.requests
            if window.total + 1 > requests_per_minute:
                wait = window.wait_s(now, requests_per_minute, 1)
                if wait > 0:
                    return Refusal("requests_per_minute", requests_per_minute, wait)
            window.add(now, 1)
        return None

    async def admit(
        self, caller: str, requests_per_minute: int | None, tokens_per_minute: int | None
    ) -> Refusal | None:
        return self.admit_now(caller, requests_per_minute, tokens_per_minute)

    def charge_now(self, caller: str, tokens: int) -> None:
        self.windows(caller).tokens.add(self.clock(), tokens)

    async def charge_tokens(self, caller: str, tokens: int) -> None:
        self.charge_now(caller, tokens)

    async def hold_call(self, caller: str, max_concurrency: int) -> CallHold | None:
        return IN_THIS_PROCESS  # Admission's semaphore is the whole count here

    async def admit_and_hold(
        self,
        caller: str,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
        max_concurrency: int,
    ) -> Refusal | CallHold | None:
        return self.admit_now(caller, requests_per_minute, tokens_per_minute) or IN_THIS_PROCESS

    def status(self) -> str:
        return "in this process"

    async def aclose(self) -> None:
        return None


class CallGate:
    """A caller's calls in flight in this process, under its max_concurrency: a counter taken
    without awaiting while there is room (asyncio.Semaphore's fast path costs a coroutine and a
    scan of its waiters per call), and a queue of waiters, served in order, when there is none."""

    __slots__ = ("_waiters", "limit", "taken")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def full(self) -> bool:
        return self.taken >= self.limit

    def try_take(self) -> bool:
        if self.taken < self.limit and not self._waiters:
            self.taken += 1
            return True
        return False

    async def take(self) -> None:
        """Waits for room (a releasing call hands its place over directly)."""
        if self.try_take():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a place while being cancelled: pass it on
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the place goes to the waiter: `taken` stays
                return
        self.taken -= 1


class Admission:
    """Admits a caller's calls under its quotas; the core asks it once per call (or batch item)."""

    def __init__(self, state: LimitState | None = None) -> None:
        self.state: LimitState = state if state is not None else LocalLimits()
        # Windows in this process: admitted without awaiting anything.
        self._local = self.state if isinstance(self.state, LocalLimits) else None
        self._running: dict[str, CallGate] = {}
        # Each caller's gate and windows where the windows are in this process: one lookup a call.
        self._quotas: dict[str, _LocalQuota] = {}

    def admit_now(self, caller: Caller, *, wait: bool = False) -> Admitted | None:
        """`admit` without awaiting, where it needs none: windows in this process and room under
        max_concurrency (the common case: no coroutine per call). None: await `admit` instead."""
        local = self._local
        if local is None:
            return None
        quota = self._quotas.get(caller.name)
        if quota is None:
            quota = self._quotas[caller.name] = self._local_quota(caller, local)
        gate = quota.gate
        if gate is not None:
            # CallGate.try_take, spelled out: once per call
            if gate.taken < gate.limit and not gate._waiters:
                gate.taken += 1
            elif not wait:
                raise concurrency_exceeded(caller)
            else:
                return None
        windows = quota.windows
        if windows is not None:
            refusal = local.admit_windows(windows, caller.requests_per_minute, caller.tokens_per_minute)
            if refusal is not None:
                if gate is not None:
                    gate.release()
                raise over_quota(caller, refusal)
        return Admitted(self, caller, gate, None, quota.tokens)

    def _local_quota(self, caller: Caller, local: LocalLimits) -> _LocalQuota:
        gate = self._gate(caller, caller.max_concurrency) if caller.max_concurrency is not None else None
        windows = local.windows(caller.name)
        has_windows = caller.requests_per_minute is not None or caller.tokens_per_minute is not None
        tokens = windows.tokens if caller.tokens_per_minute is not None else None
        return _LocalQuota(gate, windows if has_windows else None, tokens)

    async def admit(self, caller: Caller, *, wait: bool = False) -> Admitted:
        """A pass for one call of `caller`, or ResourceExhausted with RetryInfo. `wait`: wait for
        room under max_concurrency instead of refusing (batch items: a batch bounds itself)."""
        passed = self.admit_now(caller, wait=wait)
        if passed is not None:
            return passed
        gate = None
        hold: CallHold | None = None
        if caller.max_concurrency is not None:
            gate = self._gate(caller, caller.max_concurrency)
            if not gate.try_take():
                if not wait:
                    raise concurrency_exceeded(caller)
                await gate.take()
        windows = caller.requests_per_minute is not None or caller.tokens_per_minute is not None
        try:
            if self._local is not None:
                # In this process the gate is the whole count: only the windows are left.
                refusal = (
                    self._local.admit_now(caller.name, caller.requests_per_minute, caller.tokens_per_minute)
                    if windows
                    else None
                )
                if refusal is not None:
                    raise over_quota(caller, refusal)
            elif caller.max_concurrency is not None:
                hold = await self._hold(caller, caller.max_concurrency, wait, windows=windows)
            elif windows:
                refusal = await self.state.admit(
                    caller.name, caller.requests_per_minute, caller.tokens_per_minute
                )
                if refusal is not None:
                    raise over_quota(caller, refusal)
        except BaseException:
            if hold is not None:
                hold.release()
            if gate is not None:
                gate.release()
            raise
        return Admitted(self, caller, gate, hold)

    def _gate(self, caller: Caller, limit: int) -> CallGate:
        gate = self._running.get(caller.name)
        if gate is None:
            gate = self._running[caller.name] = CallGate(limit)
        return gate

    async def _hold(self, caller: Caller, max_concurrency: int, wait: bool, *, windows: bool) -> CallHold:
        """The call counted where the state keeps calls, admitted under the windows too when it
        has any (one step); while other replicas' calls fill the limit, refused (or, with `wait`,
        tried again: nothing here says when theirs end)."""
        pause = HOLD_RETRY_FIRST_S
        while True:
            got = (
                await self.state.admit_and_hold(
                    caller.name, caller.requests_per_minute, caller.tokens_per_minute, max_concurrency
                )
                if windows
                else await self.state.hold_call(caller.name, max_concurrency)
            )
            if isinstance(got, Refusal):
                raise over_quota(caller, got)
            if got is not None:
                return got
            if not wait:
                raise concurrency_exceeded(caller)
            await asyncio.sleep(pause)
            pause = min(pause * 2, HOLD_RETRY_MAX_S)

    async def aclose(self) -> None:
        await self.state.aclose()


class _LocalQuota:
    """What admits one caller's calls where the windows are in this process: its gate (None
    without max_concurrency), its windows (None without a per-minute quota) and the token
    window its usage is charged to (None without tokens_per_minute)."""

    __slots__ = ("gate", "tokens", "windows")

    def __init__(
        self, gate: CallGate | None, windows: CallerWindows | None, tokens: SlidingWindow | None
    ) -> None:
        self.gate = gate
        self.windows = windows
        self.tokens = tokens


class Admitted:
    """One admitted call: charge its tokens as they are known, release it when it ends."""

    __slots__ = ("_admission", "_gate", "_hold", "_tokens", "caller")

    def __init__(
        self,
        admission: Admission,
        caller: Caller,
        gate: CallGate | None,
        hold: CallHold | None = None,
        tokens: SlidingWindow | None = None,
    ) -> None:
        self._admission = admission
        self.caller = caller
        self._gate = gate
        self._hold = hold
        self._tokens = tokens  # the token window in this process, when admitted by admit_now

    def charge_now(self, tokens: int) -> bool:
        """Charges `tokens` without awaiting where the windows are in this process (or there is
        nothing to charge); False: they are shared, `await charge(tokens)` instead."""
        if tokens <= 0 or self.caller.tokens_per_minute is None:
            return True
        local = self._admission._local
        if local is None:
            return False
        window = self._tokens
        if window is None:  # admitted by `admit` (it waited for room)
            window = local.windows(self.caller.name).tokens
        window.add(local.clock(), tokens)
        return True

    async def charge(self, tokens: int) -> None:
        if not self.charge_now(tokens):
            await self._admission.state.charge_tokens(self.caller.name, tokens)

    def release(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()
        gate, self._gate = self._gate, None
        if gate is not None:
            if gate._waiters:
                gate.release()
            else:  # CallGate.release without waiters, spelled out: once per call
                gate.taken -= 1


def concurrency_exceeded(caller: Caller) -> ResourceExhausted:
    """The RESOURCE_EXHAUSTED of a call over its caller's max_concurrency, with RetryInfo."""
    return ResourceExhausted(
        f"caller {caller.name!r} has {caller.max_concurrency} calls in flight (its max_concurrency)",
        reason="CALLER_CONCURRENCY_EXCEEDED",
        retry_after_s=CONCURRENCY_RETRY_S,
        metadata={"caller": caller.name, "limit": "max_concurrency", "quota": str(caller.max_concurrency)},
    )


def over_quota(caller: Caller, refusal: Refusal) -> ResourceExhausted:
    """The RESOURCE_EXHAUSTED a refusal answers, with RetryInfo (and so `retry-after`)."""
    reason = "REQUEST_RATE_EXCEEDED" if refusal.limit == "requests_per_minute" else "TOKEN_RATE_EXCEEDED"
    spent = "requests" if refusal.limit == "requests_per_minute" else "tokens"
    return ResourceExhausted(
        f"caller {caller.name!r} has used its {refusal.limit} ({refusal.quota} {spent} a minute); "
        f"retry in {max(1, round(refusal.retry_after_s))} s",
        reason=reason,
        retry_after_s=refusal.retry_after_s,
        metadata={"caller": caller.name, "limit": refusal.limit, "quota": str(refusal.quota)},
    )
