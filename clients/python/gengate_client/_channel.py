"""The asyncio client's channel: made in the event loop that uses it (grpc.aio channels belong to
one loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc.aio


class LoopChannel:
    """A grpc.aio channel made on first use in the running event loop, and made anew when a call
    comes from another loop (the first one ended): grpc.aio channels belong to one loop, so a
    client built at module level and used under `asyncio.run(...)`, once or several times, works.
    One loop at a time."""

    def __init__(self, make: Callable[[], grpc.aio.Channel]) -> None:
        self._make = make
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stubs: dict[type, Any] = {}

    def stub(self, kind: type) -> Any:
        """The `kind` stub (e.g. GenerationServiceStub) on the running loop's channel."""
        loop = asyncio.get_running_loop()
        if self._channel is None or self._loop is not loop:
            self._channel, self._loop, self._stubs = self._make(), loop, {}
        stub = self._stubs.get(kind)
        if stub is None:
            stub = self._stubs[kind] = kind(self._channel)
        return stub

    async def close(self) -> None:
        """Closes the channel if it belongs to the running loop; one made in another loop is only
        dropped (grpc.aio closes it when it is collected). A later call makes a new one."""
        channel, loop = self._channel, self._loop
        self._channel, self._loop, self._stubs = None, None, {}
        if channel is not None and loop is asyncio.get_running_loop():
            await channel.close()
