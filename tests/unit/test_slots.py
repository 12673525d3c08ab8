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
