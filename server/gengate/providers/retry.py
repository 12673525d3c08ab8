"""The one retry policy for providers: exponential backoff with full jitter on 429/5xx/connection
errors, honouring Retry-After and never sleeping past the caller's deadline.

SDKs are configured with their own retries off (max_retries=0) so only this policy applies.
Each attempt's answer, and each retry with its reason, is noted for the call's metrics
(gengate.observation).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from gengate import errors
from gengate.backend import aclose_stream
from gengate.observation import note_upstream
from gengate.providers.errors import is_retryable, normalize_exception

T = TypeVar("T")
log = logging.getLogger("gengate.providers")


@dataclass(frozen=True)
class RetryPolicy:
    """How many extra attempts, and the backoff curve between them (seconds)."""

    max_retries: int = 2
    base_delay_s: float = 0.5
    max_delay_s: float = 20.0

    def backoff(self, attempt: int, retry_after_s: float | None) -> float:
        """Delay before attempt `attempt + 1`: Retry-After when the server gave one, else jittered."""
        if retry_after_s is not None:
            return min(retry_after_s, self.max_delay_s * 3)
        ceiling = min(self.max_delay_s, self.base_delay_s * (2**attempt))
        return random.uniform(ceiling / 2, ceiling)


def remaining(deadline: float | None) -> float | None:
    """Seconds until `deadline` (time.monotonic()), or None without one."""
    return None if deadline is None else deadline - time.monotonic()


def _deadline_error(provider: str) -> errors.DeadlineExceeded:
    return errors.DeadlineExceeded(f"the caller's deadline passed while waiting for {provider}")


async def call_with_retries(
    attempt_fn: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    deadline: float | None,
    provider: str,
    normalize: Callable[[BaseException], errors.GengateError] | None = None,
) -> T:
    """Runs `attempt_fn` until it succeeds, a non-retryable error occurs, retries run out or the
    next sleep would pass the deadline; raises the normalised gengate error."""
    to_error = normalize or (lambda exc: normalize_exception(exc, provider=provider))
    attempt = 0
    while True:
        left = remaining(deadline)
        if left is not None and left <= 0:
            raise _deadline_error(provider)
        try:
            async with asyncio.timeout(left):
                answer = await attempt_fn()
        except TimeoutError as exc:
            note_upstream("timeout")
            if remaining(deadline) is not None and remaining(deadline) <= 0:  # type: ignore[operator]
                raise _deadline_error(provider) from exc
            raise to_error(exc) from exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = to_error(exc)
            delay = _next_delay(error, attempt, policy, deadline, provider)
            note_upstream(upstream_answer(error), None if delay is None else error.reason)
            if delay is None:
                raise error from exc
        else:
            note_upstream("ok")
            return answer
        attempt += 1
        await asyncio.sleep(delay)


def upstream_answer(error: errors.GengateError) -> str:
    """What an upstream attempt that failed answered, as a metrics label: its HTTP status, or
    what went wrong when there was none (a timeout, no connection, an unreadable answer)."""
    status = error.metadata.get("upstream_status")
    if status is not None and status.isdigit():
        return status
    if isinstance(error, errors.DeadlineExceeded):
        return "timeout"
    if error.reason == "UPSTREAM_UNAVAILABLE":
        return "unreachable"
    return "bad_response" if error.reason.startswith("UPSTREAM_") else "error"


def _next_delay(
    error: errors.GengateError, attempt: int, policy: RetryPolicy, deadline: float | None, provider: str
) -> float | None:
    """The sleep before the next attempt, or None when the error should be raised now."""
    if not is_retryable(error):
        return None
    if attempt >= policy.max_retries:
        if attempt > 0:
            error.message = f"{error.message} (after {attempt + 1} attempts)"
        return None
    delay = policy.backoff(attempt, error.retry_after_s)
    left = remaining(deadline)
    if left is not None and delay >= left:
        error.message = f"{error.message} (no retry: the caller's deadline is too close)"
        return None
    log.info(
        "%s: retrying after %s (attempt %d of %d, sleeping %.2fs)",
        provider,
        error.reason,
        attempt + 2,
        policy.max_retries + 1,
        delay,
    )
    return delay


async def stream_with_retries(
    open_stream: Callable[[], AsyncIterator[T]],
    *,
    policy: RetryPolicy,
    deadline: float | None,
    provider: str,
    normalize: Callable[[BaseException], errors.GengateError] | None = None,
) -> AsyncGenerator[T, None]:
    """Yields from a fresh upstream stream; retries only until the first item was yielded.

    Closing this generator closes the upstream one (and so its HTTP response)."""
    to_error = normalize or (lambda exc: normalize_exception(exc, provider=provider))
    attempt = 0
    while True:
        stream = open_stream()
        yielded = False
        try:
            while True:
                left = remaining(deadline)
                if left is not None and left <= 0:
                    raise _deadline_error(provider)
                try:
                    async with asyncio.timeout(left):
                        item = await anext(stream)
                except StopAsyncIteration:
                    if not yielded:
                        note_upstream("ok")
                    return
                if not yielded:
                    note_upstream("ok")
                yielded = True
                yield item
        except asyncio.CancelledError:
            raise
        except GeneratorExit:
            raise
        except TimeoutError as exc:
            if not yielded:
                note_upstream("timeout")
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise _deadline_error(provider) from exc
            raise to_error(exc) from exc
        except Exception as exc:
            error = to_error(exc)
            delay = None if yielded else _next_delay(error, attempt, policy, deadline, provider)
            if not yielded:  # a stream that broke after it answered was an "ok" answer
                note_upstream(upstream_answer(error), None if delay is None else error.reason)
            if delay is None:
                raise error from exc
        finally:
            await aclose_stream(stream)
        attempt += 1
        await asyncio.sleep(delay)
