"""Caller authentication: bearer tokens in the `authorization` metadata.

Health checks and reflection stay open so load balancers and tools work without a token.
Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from gengate.api.status import GRPC_CODES, to_rpc_status, trailing_metadata
from gengate.errors import ConfigError, GengateError, StatusCode

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class Unauthenticated(GengateError):
    code = StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


def tokens_from_env(variable: str) -> frozenset[str]:
    """The accepted tokens: comma-separated in `variable`; an empty or unset variable is an error."""
    raw = os.environ.get(variable, "")
    tokens = frozenset(t.strip() for t in raw.split(",") if t.strip())
    if not tokens:
        raise ConfigError(f"server.auth_tokens_env names {variable}, which holds no token")
    return tokens


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, tokens: frozenset[str]) -> None:
        self._tokens = tuple(t.encode() for t in tokens)

    def _valid(self, metadata: tuple[tuple[str, str | bytes], ...]) -> bool | None:
        """True: a valid token; False: a wrong one; None: none given."""
        for key, value in metadata:
            if key.lower() == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, token = text.partition(" ")
                if scheme.lower() != "bearer":
                    return False
                given = token.strip().encode()
                return any(hmac.compare_digest(given, t) for t in self._tokens)
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method or ""
        if method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        verdict = self._valid(tuple(handler_call_details.invocation_metadata or ()))
        if verdict:
            return await continuation(handler_call_details)
        error = (
            Unauthenticated(
                "missing bearer token in the authorization metadata", reason="MISSING_CREDENTIALS"
            )
            if verdict is None
            else Unauthenticated("invalid bearer token", reason="INVALID_CREDENTIALS")
        )
        handler = await continuation(handler_call_details)
        return None if handler is None else _rejecting(handler, error)


def _rejecting(
    handler: grpc.RpcMethodHandler[Any, Any], error: GengateError
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as `handler` that ends the call with `error`."""
    status = to_rpc_status(error)

    async def reject(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        context.set_trailing_metadata(trailing_metadata(status))
        await context.abort(GRPC_CODES[error.code], error.message)

    async def reject_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await reject(request, context)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(reject, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(reject_stream, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(reject, **kwargs)
    return grpc.stream_stream_rpc_method_handler(reject_stream, **kwargs)
