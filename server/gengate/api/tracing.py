"""The RPC span: OpenTelemetry's gRPC aio server interceptor, with two fixes around it.

Installed only when a tracer provider is (configure_tracing runs first): with none, its spans
are no-ops that would still cost ~0.1 ms per call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from gengate.api import OPEN_SERVICES
from gengate.telemetry import tracing_enabled

if TYPE_CHECKING:
    Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]]
    # A streaming handler's behaviour on the aio server: an async generator function (grpc's
    # stubs type handler behaviours for the sync server only).
    StreamBehavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]
    WritingBehavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]


CALLER_ATTRIBUTE = "gengate.caller"


def mark_caller(name: str) -> None:
    """Puts the caller's name on the call's RPC span (the current span inside the handler; a
    no-op when tracing is off). Never a token: only the configured name."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(CALLER_ATTRIBUTE, name)


def tracing_interceptor() -> grpc.aio.ServerInterceptor | None:
    """The RPC-span interceptor, or None when tracing is off or its package is not installed."""
    if not tracing_enabled():
        return None
    try:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor
    except ImportError:  # tracing is optional at run time
        return None
    return SkipOpenServices(ClosingStreams(aio_server_interceptor()))  # type: ignore[no-untyped-call]


class SkipOpenServices(grpc.aio.ServerInterceptor):
    """Runs `inner` for gengate's own RPCs only; health and reflection pass straight through.

    OpenTelemetry's aio server interceptor iterates every server-streaming handler with
    `async for`, but grpc_health's Health.Watch is a coroutine: under it, Watch ended UNKNOWN
    (upstream opentelemetry-python-contrib#3066).
    """

    def __init__(self, inner: grpc.aio.ServerInterceptor) -> None:
        self._inner = inner

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if (handler_call_details.method or "").startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        return await self._inner.intercept_service(continuation, handler_call_details)


class ClosingStreams(grpc.aio.ServerInterceptor):
    """Drives `inner`'s server-streaming handlers from the RPC's own task.

    gRPC iterates a streaming handler's async generator itself; when the caller cancels while the
    server waits to write, it drops the generator, which the event loop then closes in another
    task. The RPC span the interceptor made current inside it was attached in the RPC's Context
    and cannot be detached from that one: "Failed to detach context", an ERROR log per cancelled
    stream (upstream opentelemetry-python-contrib#2357). Written with `context.write` instead, the
    handler closes its generator where it was iterated. (The backend span is never held current
    across a yield: telemetry.BackendSpan.events.)
    """

    def __init__(self, inner: grpc.aio.ServerInterceptor) -> None:
        self._inner = inner

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await self._inner.intercept_service(continuation, handler_call_details)
        if handler is None or not handler.response_streaming:
            return handler
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_writing(handler.unary_stream), **kwargs)
        return grpc.stream_stream_rpc_method_handler(_writing(handler.stream_stream), **kwargs)


def _writing(behavior: Any) -> WritingBehavior:
    """A coroutine handler writing what `behavior` (a StreamBehavior) yields, and closing it in
    this task."""
    stream: StreamBehavior = behavior

    async def write_all(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        async with aclosing(stream(request, context)) as responses:  # type: ignore[type-var]
            async for response in responses:
                await context.write(response)

    return write_all
