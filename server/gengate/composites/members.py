"""The handle a composite gets on a member model: the member's limits and tracing still apply."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from gengate.backend import aclose_stream
from gengate.domain import GenerationEnd, GenerationRequest, GenerationResult, ModelCapabilities, StreamEvent
from gengate.telemetry import backend_span

if TYPE_CHECKING:
    from gengate.router import Route


class MemberBackend:
    """Calls a member's backend through its route: each call holds one of the member's
    concurrency slots (so its max_concurrency and max_queue bind composites too; a full queue is
    RESOURCE_EXHAUSTED, which a fallback moves past) and gets its own span under the composite's."""

    def __init__(self, route: Route) -> None:
        self._route = route
        self.name = route.name
        self.kind = route.config.backend

    @property
    def capabilities(self) -> ModelCapabilities:
        """The member's current capabilities (engines settle theirs when they load)."""
        return self._route.backend.capabilities

    @capabilities.setter
    def capabilities(self, value: ModelCapabilities) -> None:
        raise AttributeError("a member's capabilities belong to the member")

    async def start(self) -> None:
        """The router starts the member itself."""

    async def aclose(self) -> None:
        """The router closes the member itself."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        with backend_span(self._route, request) as span:
            async with self._route.slot():
                result = await self._route.backend.generate(request)
            span.record_result(result)
        return result

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        with backend_span(self._route, request, current=False) as span:
            async with self._route.slot():
                stream = self._route.backend.generate_stream(request)
                try:
                    async for event in span.events(stream):
                        if isinstance(event, GenerationEnd):
                            span.record_end(event)
                        yield event
                finally:
                    await aclose_stream(stream)
