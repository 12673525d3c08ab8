"""grpc.health.v1.Health with each model's health behind the caller token.

Overall health ("") and the service's own name stay open, so load balancers and probes work
without a token; a single model's name (`gengate.v1.GenerationService/<model>`) tells which
models are served and how they fare, so with authentication on it needs a valid token. Any
other name needs one too: NOT_FOUND for an unknown name would tell a caller without a token
which models exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from gengate.api.auth import TokenCheck, reject


class GuardedHealthServicer(health.aio.HealthServicer):  # type: ignore[misc]  # grpc_health is untyped
    """grpc_health's servicer; names outside `open_names` answer UNAUTHENTICATED without a token."""

    def __init__(self, check: TokenCheck | None, open_names: Iterable[str] = ("",)) -> None:
        super().__init__()
        self._check = check
        self._open = frozenset(open_names)

    async def _allowed(self, service: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Returns when the caller may see `service`'s health; else ends the call UNAUTHENTICATED."""
        if self._check is None or service in self._open:
            return
        error = self._check.error(tuple(context.invocation_metadata() or ()))
        if error is not None:
            await reject(context, error)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        await self._allowed(request.service, context)
        return await super().Check(request, context)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        await self._allowed(request.service, context)
        await super().Watch(request, context)
