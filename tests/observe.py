"""Helpers for integration tests that wait for what the server does (no wall-clock thresholds)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gengate.api.server import RunningServer

ServerFactory = Callable[[dict[str, Any]], Awaitable[RunningServer]]


async def until(condition: Callable[[], bool], what: str) -> None:
    """Waits for an observable event `what`; a test stuck here fails by pytest's timeout, not by
    a wall-clock threshold of its own."""
    while not condition():
        await asyncio.sleep(0.02)
