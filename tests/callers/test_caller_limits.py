"""Caller quotas in one process: per-minute sliding windows (on a fake clock: no waiting) and
calls at once, through the Admission the core asks."""

from __future__ import annotations

import asyncio

import pytest
from gengate.callers.identity import Caller
from gengate.callers.limits import Admission, CallGate, LocalLimits, SlidingWindow
from gengate.errors import ResourceExhausted


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_window_forgets_a_charge_a_minute_later_and_says_when() -> None:
    window = SlidingWindow()
    window.add(100.2, 3)
    window.add(130.7, 2)
    assert window.used(159.9) == 5
    assert window.wait_s(150.0, limit=5, cost=0) == 0.0
    # one more needs the charge of second 100 to leave: at 160 (its second plus the window)
    assert window.wait_s(150.0, limit=5, cost=1) == pytest.approx(10.0)
    assert window.used(160.0) == 2
    # three more need the second charge to leave too: at 190
    assert window.wait_s(150.0, limit=5, cost=4) == pytest.approx(40.0)
    assert window.used(190.0) == 0
    assert window.wait_s(150.0, limit=5, cost=6) == 60.0  # never fits: a whole window


def test_requests_per_minute_admits_the_quota_then_refuses_until_the_window_slides() -> None:
    clock = Clock()
    limits = LocalLimits(clock)
    assert all(limits.admit_now("a", 3, None) is None for _ in range(3))
    refusal = limits.admit_now("a", 3, None)
    assert refusal is not None and refusal.limit == "requests_per_minute" and refusal.quota == 3
    assert 0 < refusal.retry_after_s <= 60
    assert limits.admit_now("b", 3, None) is None  # each caller has its own window
    clock.now += refusal.retry_after_s - 0.001
    assert limits.admit_now("a", 3, None) is not None  # not a moment before it says
    clock.now += 0.001
    # all three were charged in one second, so they leave the window together
    assert all(limits.admit_now("a", 3, None) is None for _ in range(3))
    assert limits.admit_now("a", 3, None) is not None


def test_a_refused_request_is_not_charged() -> None:
    clock = Clock()
    limits = LocalLimits(clock)
    limits.charge_now("a", 100)  # tokens spent
    for _ in range(5):
        refusal = limits.admit_now("a", 2, 100)
        assert refusal is not None and refusal.limit == "tokens_per_minute"
    clock.now += 61
    assert limits.admit_now("a", 2, 100) is None  # the refused ones took none of the 2 requests
    assert limits.admit_now("a", 2, 100) is None


def test_tokens_refuse_only_once_the_window_is_spent() -> None:
    clock = Clock()
    limits = LocalLimits(clock)
    assert limits.admit_now("a", None, 100) is None
    limits.charge_now("a", 99)  # one token of room left: the next call is admitted...
    assert limits.admit_now("a", None, 100) is None
    limits.charge_now("a", 50)  # ...and may go past the quota; then the window is spent
    refusal = limits.admit_now("a", None, 100)
    assert refusal is not None and refusal.limit == "tokens_per_minute"
    assert refusal.retry_after_s == pytest.approx(60.0)  # everything was charged this second


async def test_max_concurrency_refuses_the_call_over_it_and_frees_on_release() -> None:
    admission = Admission()
    caller = Caller("a", max_concurrency=2)
    first = await admission.admit(caller)
    second = await admission.admit(caller)
    with pytest.raises(ResourceExhausted) as caught:
        await admission.admit(caller)
    error = caught.value
    assert error.reason == "CALLER_CONCURRENCY_EXCEEDED" and error.retry_after_s is not None
    assert error.metadata == {"caller": "a", "limit": "max_concurrency", "quota": "2"}
    await admission.admit(Caller("b", max_concurrency=1))  # another caller: its own count
    first.release()
    first.release()  # twice is once
    third = await admission.admit(caller)
    second.release()
    third.release()


async def test_batch_items_wait_for_room_under_max_concurrency() -> None:
    admission = Admission()
    caller = Caller("a", max_concurrency=1)
    held = await admission.admit(caller)
    waiting = asyncio.create_task(admission.admit(caller, wait=True))
    await asyncio.sleep(0)
    assert not waiting.done()
    held.release()
    (await waiting).release()


async def test_waiters_for_room_are_served_in_arrival_order() -> None:
    gate = CallGate(1)
    assert gate.try_take() and gate.full()
    served: list[int] = []

    async def wait(i: int) -> None:
        await gate.take()
        served.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert not gate.try_take()  # someone is waiting: no jumping the queue
    for _ in range(3):
        gate.release()
        await asyncio.sleep(0)
    await asyncio.gather(*waiters)
    assert served == [0, 1, 2] and gate.taken == 1
    gate.release()
    assert gate.taken == 0 and not gate.full()


async def test_a_waiter_cancelled_after_being_handed_a_place_passes_it_on() -> None:
    gate = CallGate(1)
    gate.try_take()
    first = asyncio.create_task(gate.take())
    second = asyncio.create_task(gate.take())
    await asyncio.sleep(0)
    gate.release()  # hands the place to `first`...
    first.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # the place reached `second`
    assert gate.taken == 1
    third = asyncio.create_task(gate.take())
    await asyncio.sleep(0)
    third.cancel()  # cancelled while waiting: it leaves the queue
    with pytest.raises(asyncio.CancelledError):
        await third
    gate.release()
    assert gate.taken == 0 and gate.try_take()


async def test_over_a_rate_the_error_carries_retry_info_and_frees_the_concurrency_slot() -> None:
    clock = Clock()
    admission = Admission(LocalLimits(clock))
    caller = Caller("a", requests_per_minute=1, max_concurrency=1)
    (await admission.admit(caller)).release()
    with pytest.raises(ResourceExhausted) as caught:
        await admission.admit(caller)
    assert caught.value.reason == "REQUEST_RATE_EXCEEDED"
    assert caught.value.retry_after_s == pytest.approx(60.0)
    assert caught.value.metadata["limit"] == "requests_per_minute"
    clock.now += 60
    (await admission.admit(caller)).release()  # the refused call left its slot free


async def test_tokens_are_charged_only_for_callers_with_a_token_quota() -> None:
    clock = Clock()
    state = LocalLimits(clock)
    admission = Admission(state)
    spender = await admission.admit(Caller("a", tokens_per_minute=10))
    await spender.charge(10)
    with pytest.raises(ResourceExhausted) as caught:
        await admission.admit(Caller("a", tokens_per_minute=10))
    assert caught.value.reason == "TOKEN_RATE_EXCEEDED"
    free = await admission.admit(Caller("b", max_concurrency=5))
    await free.charge(10**6)
    assert state.admit_now("b", None, 1) is None  # nothing was recorded for b
