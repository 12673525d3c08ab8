"""grpc.health.v1.Health with each model's health behind the caller's credentials.

Overall health ("") and the service's own name stay open, so load balancers and probes work
without a token; a single model's name (`gengate.v1.GenerationService/<model>`) tells which
models are served and how they fare, so with callers configured it needs a known caller, and
one that may use the model (PERMISSION_DENIED otherwise). Any other name needs a known caller
too: NOT_FOUND for an unknown name would tell a caller without a token which models exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from gengate.api.auth import identify, reject
from gengate.callers.identity import CallerDirectory
from gengate.errors import PermissionDenied, Unauthenticated


class GuardedHealthServicer(health.aio.HealthServicer):  # type: ignore[misc]  # grpc_health is untyped
    """grpc_health's servicer; names outside `open_names` answer UNAUTHENTICATED without a known
    caller, and a model's name PERMISSION_DENIED to a caller that may not use the model."""

    def __init__(
        self,
        directory: CallerDirectory | None,
        open_names: Iterable[str] = ("",),
        model_prefix: str = "",
    ) -> None:
        super().__init__()
        self._directory = directory
        self._open = frozenset(open_names)
        self._model_prefix = model_prefix

    async def _allowed(self, service: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Returns when the caller may see `service`'s health; else ends the call."""
        if self._directory is None or service in self._open:
            return
        try:
            caller = identify(self._directory, context)
        except Unauthenticated as exc:
            await reject(context, exc)
        if self._model_prefix and service.startswith(self._model_prefix):
            model = service[len(self._model_prefix) :]
            if not caller.may_use(model):
                await reject(
                    context,
                    PermissionDenied(
                        f"caller {caller.name!r} may not use this model", reason="MODEL_NOT_ALLOWED"
                    ),
                )

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
