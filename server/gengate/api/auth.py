"""Caller authentication: bearer tokens in the `authorization` metadata.

Health checks and reflection stay open so load balancers and tools work without a token (a
single model's health needs one: api/health.py). Tokens are compared in constant time, and
registered for redaction so they are never logged. A rejected call's body is never parsed.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from gengate.api.status import GRPC_CODES, to_rpc_status, trailing_metadata
from gengate.errors import ConfigError, GengateError, StatusCode
from gengate.redaction import register_secret

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class Unauthenticated(GengateError):
    code = StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


def tokens_from_env(variable: str) -> frozenset[str]:
    """The accepted tokens: comma-separated in `variable`; an empty or unset variable is an error.

    Each token is registered for redaction, so no log line or error message can carry one."""
    raw = os.environ.get(variable)
    if raw is None:
        raise ConfigError(f"server.auth_tokens_env names {variable}, which is not set")
    tokens = frozenset(t.strip() for t in raw.split(",") if t.strip())
    if not tokens:
        raise ConfigError(f"server.auth_tokens_env names {variable}, which holds no token")
    for token in tokens:
        register_secret(token)
    return tokens


Metadata = Sequence[tuple[str, str | bytes]]


class TokenCheck:
    """The one bearer-token check (constant-time), shared by the interceptor and health."""

    def __init__(self, tokens: frozenset[str]) -> None:
        self._tokens = tuple(t.encode() for t in tokens)

    def verdict(self, metadata: Metadata | None) -> bool | None:
        """True: a valid token; False: a wrong one; None: none given."""
        for key, value in metadata or ():
            if key.lower() == "authorization":
                text = value.decode(errors="replace") if isinstance(value, bytes) else value
                scheme, _, token = text.partition(" ")
                if scheme.lower() != "bearer":
                    return False
                given = token.strip().encode()
                # Every token is compared (no early exit), each in constant time.
                return any([hmac.compare_digest(given, t) for t in self._tokens])
        return None

    def error(self, metadata: Metadata | None) -> Unauthenticated | None:
        """None when the metadata holds a valid token, else the UNAUTHENTICATED error to answer."""
        verdict = self.verdict(metadata)
        if verdict:
            return None
        if verdict is None:
            return Unauthenticated(
                "missing bearer token in the authorization metadata", reason="MISSING_CREDENTIALS"
            )
        return Unauthenticated("invalid bearer token", reason="INVALID_CREDENTIALS")


async def reject(context: grpc.aio.ServicerContext[Any, Any], error: GengateError) -> None:
    """Ends the call with `error`: its code, message and google.rpc details."""
    context.set_trailing_metadata(trailing_metadata(to_rpc_status(error)))
    await context.abort(GRPC_CODES[error.code], error.message)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, tokens: frozenset[str] | TokenCheck) -> None:
        self.check = tokens if isinstance(tokens, TokenCheck) else TokenCheck(tokens)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method or ""
        if method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        error = self.check.error(tuple(handler_call_details.invocation_metadata or ()))
        if error is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else _rejecting(handler, error)


def _ignore_body(data: bytes) -> None:
    """The request deserializer of a rejected call: its bytes are never parsed (an unauthenticated
    caller cannot make the server decode anything, nor tell a bad body from a bad token)."""
    return None


def _rejecting(
    handler: grpc.RpcMethodHandler[Any, Any], error: GengateError
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as `handler` that ends the call with `error`, body unread."""

    async def reject_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await reject(context, error)

    async def reject_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await reject(context, error)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(reject_unary, _ignore_body, serialize)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(reject_stream, _ignore_body, serialize)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(reject_unary, _ignore_body, serialize)
    return grpc.stream_stream_rpc_method_handler(reject_stream, _ignore_body, serialize)
