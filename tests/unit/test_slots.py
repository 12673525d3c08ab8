"""A model's concurrency slots give interactive calls priority over background (batch job)
items: a freed slot goes to a waiting interactive call first, background never jumps an
interactive waiter, and a waiter that leaves never loses or leaks a slot."""

from __future__ import annotations

import asyncio

from gengate.router import Slots


async def test_a_freed_slot_goes_to_interactive_callers_first() -> None:
    slots = Slots(1)
    await slots.acquire()
    order: list[str] = []

    async def take(name: str, background: bool) -> None:
        await slots.acquire(background=background)
        order.append(name)
        await asyncio.sleep(0)
        slots.release(background=background)

    tasks = [asyncio.create_task(take(f"job{i}", True)) for i in range(3)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(take(f"call{i}", False)) for i in range(2)]  # arrive later
    await asyncio.sleep(0)
    slots.release()
    await asyncio.gather(*tasks)
    assert order == ["call0", "call1", "job0", "job1", "job2"]


async def test_background_waits_while_an_interactive_call_waits() -> None:
    slots = Slots(2)
    await slots.acquire()
    await slots.acquire()
    interactive = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    slots.release()  # goes to the interactive waiter
    await interactive
    background = asyncio.create_task(slots.acquire(background=True))
    await asyncio.sleep(0)
    assert not background.done()
    slots.release()  # the call ends: one job item may run beside the one still running
    await background


async def test_a_cancelled_waiter_passes_its_slot_on() -> None:
    slots = Slots(1)
    await slots.acquire()
    leaving = asyncio.create_task(slots.acquire())
    staying = asyncio.create_task(slots.acquire(background=True))
    await asyncio.sleep(0)
    slots.release()  # handed to `leaving`...
    leaving.cancel()  # ...which is cancelled before it runs: the slot moves on
    await asyncio.gather(leaving, return_exceptions=True)
    await staying
    slots.release(background=True)
    await slots.acquire()  # exactly one slot again: free now, not leaked or doubled
    task = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    assert not task.done()
    task.cancel()


async def test_while_calls_run_background_work_keeps_to_one_slot_then_widens() -> None:
    slots = Slots(8, quiet_s=0.05, busy_background=1)
    await slots.acquire()  # an interactive call is running
    first = asyncio.create_task(slots.acquire(background=True))
    second = asyncio.create_task(slots.acquire(background=True))
    await asyncio.sleep(0)
    assert first.done() and not second.done()  # one job item beside the call, not seven
    slots.release()  # the call ends: the quiet period starts, the job still keeps to one slot
    await asyncio.sleep(0)
    assert not second.done() and slots.background_active == 1
    await second  # ...and widens once the model has been quiet for quiet_s
    assert slots.background_active == 2 and slots.interactive_active == 0


# -- caller priority ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _admission_order(
    slots: Slots, waiters: list[tuple[str, int]], clock: Clock | None = None
) -> list[str]:
    """Queues `waiters` (name, priority) in this order behind a held slot, then frees slots one
    at a time; the order in which they got one."""
    await slots.acquire()
    order: list[str] = []

    async def take(name: str, priority: int) -> None:
        await slots.acquire(priority=priority)
        order.append(name)
        slots.release()

    tasks = []
    for name, priority in waiters:
        tasks.append(asyncio.create_task(take(name, priority)))
        await asyncio.sleep(0)
        if clock is not None:
            clock.now += 1.0
    slots.release()
    await asyncio.gather(*tasks)
    return order


async def test_a_freed_slot_goes_to_the_highest_priority_then_the_earliest() -> None:
    order = await _admission_order(
        Slots(1, aging_s=1e9), [("low0", 0), ("low1", 0), ("high0", 10), ("mid", 5), ("high1", 10)]
    )
    assert order == ["high0", "high1", "mid", "low0", "low1"]


async def test_waiting_raises_a_callers_effective_priority_so_low_priority_progresses() -> None:
    clock = Clock()
    # One point per second waited: low waited 1 s longer than high arrived, so at a priority gap
    # of 2 high still goes first; after 5 s of waiting low is worth more than a fresh high.
    slots = Slots(1, aging_s=1.0, clock=clock)
    order = await _admission_order(slots, [("low", 0), ("high", 2)], clock)
    assert order == ["high", "low"]
    clock.now = 0.0
    slots = Slots(1, aging_s=1.0, clock=clock)
    waiters = [("low", 0)] + [(f"filler{i}", -100) for i in range(4)] + [("high", 2)]
    order = await _admission_order(slots, waiters, clock)
    assert order[0] == "low" and order[1] == "high"


async def test_background_stays_below_every_caller_priority() -> None:
    slots = Slots(1, aging_s=1e9)
    await slots.acquire()
    order: list[str] = []

    async def take(name: str, priority: int, background: bool) -> None:
        await slots.acquire(priority=priority, background=background)
        order.append(name)
        slots.release(background=background)

    tasks = [asyncio.create_task(take("job", 0, True))]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(take("lowest", -1000, False)))
    await asyncio.sleep(0)
    slots.release()
    await asyncio.gather(*tasks)
    assert order == ["lowest", "job"]


async def test_a_full_queue_lets_a_higher_priority_call_displace_the_lowest_waiter() -> None:
    slots = Slots(1, aging_s=1e9)
    await slots.acquire()
    low = [asyncio.create_task(slots.acquire(priority=0)) for _ in range(2)]
    pinned = asyncio.create_task(slots.acquire(priority=-5, bounded=False))  # a batch item: never displaced
    await asyncio.sleep(0)
    error = RuntimeError("displaced")
    assert not slots.displace(0, error)  # an equal priority displaces no one
    assert slots.displace(3, error)
    await asyncio.sleep(0)
    assert low[1].done() and low[1].exception() is error  # the newest of the lowest bounded waiters
    assert not low[0].done() and not pinned.done()
    slots.release()
    await low[0]
    slots.release()
    await pinned
    slots.release()


async def test_background_work_arriving_in_a_quiet_period_starts_when_it_ends() -> None:
    slots = Slots(4, quiet_s=0.05, busy_background=0, idle_background=4)
    await slots.acquire()
    slots.release()  # the last call ended: quiet for quiet_s, no job item may start meanwhile
    item = asyncio.create_task(slots.acquire(background=True))
    await asyncio.sleep(0)
    assert not item.done()
    await item  # woken by the quiet period's end, not by another call (none comes)
    assert slots.background_active == 1


async def test_a_waiter_cancelled_while_its_slot_is_freed_leaves_quietly() -> None:
    """The holder and the waiter cancelled in one tick (a client hanging up on both): the release
    drops the cancelled waiter from the queue before its own cancellation runs, which then must
    not fail looking for it there (it did: ValueError, answered as INTERNAL)."""
    slots = Slots(1)
    await slots.acquire()
    waiter = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    waiter.cancel()  # cancels the future it waits on, now
    slots.release()  # _dispatch pops that cancelled future and skips it
    results = await asyncio.gather(waiter, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    await asyncio.wait_for(slots.acquire(), 1)  # the slot is free, not lost
    assert slots.interactive_active == 1
