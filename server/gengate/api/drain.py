"""Graceful drain: once the server is told to stop, new calls are refused with UNAVAILABLE
(reason DRAINING, so a mesh retries them on another replica) while the calls in flight finish."""

from __future__ import annotations

import asyncio

from gengate.errors import Unavailable


class Drain:
    """Whether the server drains, and how many of its calls are in flight (open services, such
    as health and reflection, are not counted: they stay served while it drains)."""

    __slots__ = ("_idle", "draining", "in_flight")

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.draining and self.in_flight <= 0:
            self._idle.set()

    def start(self) -> None:
        """From now on new calls are refused."""
        self.draining = True
        if self.in_flight <= 0:
            self._idle.set()

    async def wait(self, timeout_s: float, interrupt: asyncio.Event | None = None) -> bool:
        """Waits until no call is in flight, at most `timeout_s` (or until `interrupt` is set);
        True when every call finished."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if interrupt is not None:
            waits.append(asyncio.ensure_future(interrupt.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
        return self._idle.is_set()

    @staticmethod
    def refusal() -> Unavailable:
        return Unavailable(
            "the server is shutting down and takes no new calls; retry on another replica",
            reason="DRAINING",
        )
