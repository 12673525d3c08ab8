"""A model's queue serves callers by priority: with one slot held, the call of a higher-priority
caller is admitted before lower-priority calls that arrived first, and a full queue makes room
for it. Order is observed where the model is called (no timing): the held call waits on an
event the test sets once everyone is queued."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from gengate_client import AsyncClient
from gengate_client.errors import ResourceExhaustedError
from observe import ServerFactory, until
from teams import TOKEN_A, TOKEN_B, bearer, record_calls, with_callers

CALLERS = [
    {"name": "batchy", "token_env": "TEAM_A_TOKEN", "priority": 0},
    {"name": "urgent", "token_env": "TEAM_B_TOKEN", "priority": 10},
]


def narrow(max_queue: int = 100) -> list[dict[str, Any]]:
    return [{"name": "narrow", "backend": "scripted", "max_concurrency": 1, "max_queue": max_queue}]


async def test_a_higher_priority_call_is_admitted_before_earlier_lower_ones(
    make_server: ServerFactory,
) -> None:
    server = await make_server(with_callers(narrow(), CALLERS, priority_aging_s=3600))
    release = asyncio.Event()
    order = record_calls(server, "narrow", release)
    route = server.router.route("narrow")
    async with AsyncClient(server.address) as client:
        low, high = bearer(TOKEN_A), bearer(TOKEN_B)
        calls = [asyncio.create_task(client.generate("narrow", "holder", metadata=low))]
        await until(lambda: order == ["holder"], "the holder has the slot")
        for i in range(3):
            calls.append(asyncio.create_task(client.generate("narrow", f"low{i}", metadata=low)))
            await until(lambda i=i: route.waiting == i + 1, f"low{i} queued")
        calls.append(asyncio.create_task(client.generate("narrow", "high", metadata=high)))
        await until(lambda: route.waiting == 4, "high queued, last")
        release.set()
        await asyncio.gather(*calls)
    assert order == ["holder", "high", "low0", "low1", "low2"]


async def test_a_full_queue_makes_room_for_higher_priority_by_refusing_the_lowest(
    make_server: ServerFactory,
) -> None:
    server = await make_server(with_callers(narrow(max_queue=2), CALLERS, priority_aging_s=3600))
    release = asyncio.Event()
    order = record_calls(server, "narrow", release)
    route = server.router.route("narrow")
    async with AsyncClient(server.address, max_retries=0) as client:  # the refusals are under test
        low, high = bearer(TOKEN_A), bearer(TOKEN_B)
        holder = asyncio.create_task(client.generate("narrow", "holder", metadata=low))
        await until(lambda: order == ["holder"], "the holder has the slot")
        lows = []
        for i in range(2):
            lows.append(asyncio.create_task(client.generate("narrow", f"low{i}", metadata=low)))
            await until(lambda i=i: route.waiting == i + 1, f"low{i} queued")
        with pytest.raises(ResourceExhaustedError) as full:  # an equal priority finds the queue full
            await client.generate("narrow", "low2", metadata=low)
        assert full.value.reason == "QUEUE_FULL"
        urgent = asyncio.create_task(client.generate("narrow", "high", metadata=high))
        with pytest.raises(ResourceExhaustedError) as displaced:
            await lows[1]  # the newest of the lowest leaves the queue for it
        assert displaced.value.reason == "QUEUE_FULL" and displaced.value.retry_after
        assert "higher priority" in displaced.value.message
        await until(lambda: route.waiting == 2, "high queued in low1's place")
        release.set()
        await asyncio.gather(holder, lows[0], urgent)
    assert order == ["holder", "high", "low0"]


async def test_without_callers_the_queue_stays_first_come_first_served(make_server: ServerFactory) -> None:
    server = await make_server({"models": narrow()})
    release = asyncio.Event()
    order = record_calls(server, "narrow", release)
    route = server.router.route("narrow")
    async with AsyncClient(server.address) as client:
        calls = [asyncio.create_task(client.generate("narrow", "holder"))]
        await until(lambda: order == ["holder"], "the holder has the slot")
        for i in range(3):
            calls.append(asyncio.create_task(client.generate("narrow", f"call{i}")))
            await until(lambda i=i: route.waiting == i + 1, f"call{i} queued")
        release.set()
        await asyncio.gather(*calls)
    assert order == ["holder", "call0", "call1", "call2"]
