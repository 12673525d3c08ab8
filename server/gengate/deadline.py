"""The request's deadline around an await: one helper for the service, routes and workers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import TypeVar

from gengate.domain import GenerationRequest
from gengate.errors import DeadlineExceeded

T = TypeVar("T")

DEADLINE_PASSED = "the request's deadline passed before the model finished"


async def within_deadline(
    awaitable: Awaitable[T],
    request: GenerationRequest,
    message: str = DEADLINE_PASSED,
    reason: str | None = None,
) -> T:
    """Awaits in this task, DEADLINE_EXCEEDED once the request's deadline passes.

    asyncio.timeout instead of asyncio.wait_for: wait_for runs the call in a new task (py3.11),
    which costs a task and extra event-loop turns per request or per streamed event. A deadline
    already past never starts a coroutine. A TimeoutError the awaited code raises itself is its
    own error, not the deadline.
    """
    left = request.time_left()
    if left is None:
        return await awaitable
    if left <= 0:
        if isinstance(awaitable, Coroutine):
            awaitable.close()
        raise DeadlineExceeded(message, reason=reason)
    try:
        async with asyncio.timeout(left) as scope:
            return await awaitable
    except TimeoutError as exc:
        if scope.expired():
            raise DeadlineExceeded(message, reason=reason) from exc
        raise


async def iterate_within_deadline(
    stream: AsyncIterator[T], request: GenerationRequest, message: str = DEADLINE_PASSED
) -> AsyncIterator[T]:
    """The stream's items, each awaited under the request's deadline (not while the caller
    consumes it)."""
    while True:
        try:
            if request.deadline is None:  # the common case, without a coroutine per item
                item = await anext(stream)
            else:
                item = await within_deadline(anext(stream), request, message)
        except StopAsyncIteration:
            return
        yield item
