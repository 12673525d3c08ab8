"""Every call to gengate's own services passes here first: refused while the server drains,
then its caller identified (bearer token in the `authorization` metadata, or the client
certificate's subject under mutual TLS) and made current for the call (callers.context), its
RPC span and its log lines; then it is counted in flight until it ends.

Health checks and reflection stay open so load balancers and tools work without a token (a
single model's health needs one: api/health.py). A refused call's body is never parsed: with
callers configured, requests are deserialized only once the caller is known.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from gengate.api import OPEN_SERVICES
from gengate.api.drain import Drain
from gengate.api.status import GRPC_CODES, to_rpc_status, trailing_metadata
from gengate.api.tracing import mark_caller
from gengate.caller import current_policy, set_current
from gengate.callers.identity import Caller, CallerDirectory
from gengate.errors import GengateError, Unauthenticated

__all__ = ["OPEN_SERVICES", "CallerInterceptor", "Unauthenticated", "identify", "reject"]

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]
    Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]]


# Why the metadata grpc hands the interceptor names no caller, for the handler of the same call
# (the caller it does name is made current directly: gengate.caller). grpc runs both in the call's
# task today, so the handler need not build the metadata again (~3 µs); where it finds neither
# here, it identifies the call itself.
_refused: ContextVar[Unauthenticated | None] = ContextVar("gengate_refused", default=None)


async def reject(context: Context, error: GengateError) -> NoReturn:
    """Ends the call with `error`: its code, message and google.rpc details."""
    context.set_trailing_metadata(trailing_metadata(to_rpc_status(error)))
    await context.abort(GRPC_CODES[error.code], error.message)
    raise AssertionError("unreachable")  # abort() raises


def identify(directory: CallerDirectory, context: Context) -> Caller:
    """The call's caller (Unauthenticated when it names none); the certificate is read only when
    some caller is known by its subject."""
    auth = context.auth_context() if directory.by_certificate else None
    return directory.identify(context.invocation_metadata(), auth)


class CallerInterceptor(grpc.aio.ServerInterceptor):
    """Drain, authentication and the current caller, around every non-open method handler."""

    def __init__(self, directory: CallerDirectory | None, drain: Drain | None = None) -> None:
        self.directory = directory
        # No caller is known by its certificate: the interceptor can identify every call (read
        # once: the directory is fixed for the server's life).
        self._by_token_only = directory is not None and not directory.by_certificate
        self.drain = drain if drain is not None else Drain()
        # Whether calls have an RPC span to put the caller on (the tracing interceptor runs first).
        self.spans = True
        # Wrapped handlers by method: the server hands the same handler for a method every call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        directory = self.directory
        if directory is not None and self._by_token_only:  # a certificate needs the context
            # Every call sets the caller here, a refused one to None: one set a call, and a
            # refusal never leaves an earlier call's caller current.
            try:
                set_current(directory.identify(handler_call_details.invocation_metadata))
            except Unauthenticated as exc:
                set_current(None)
                _refused.set(exc)
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _refusal(self, context: Context) -> GengateError | None:
        """Why the call is refused (draining, or no known caller), or None: then its caller is
        current and it counts in flight (the caller of `_refusal` must `drain.leave()`). Not a
        coroutine: it runs on every call, and needs no await until a refusal is sent."""
        drain = self.drain
        if drain.draining:
            return drain.refusal()
        if self.directory is not None:
            # Identified by the interceptor (which sets every call's caller, None when refused),
            # unless a certificate needs the context: then always here.
            caller = current_policy() if self._by_token_only else None
            if caller is None:
                # Refused by the interceptor, or not identified there (a certificate needs the
                # context; and what an interceptor sets is not promised to reach the handler).
                refusal = _refused.get() if self._by_token_only else None
                if refusal is not None:
                    return refusal
                try:
                    caller = identify(self.directory, context)
                except Unauthenticated as exc:
                    return exc
                set_current(caller)  # in the handler's own context
            if self.spans:
                mark_caller(caller.name)
        drain.enter()
        return None

    def _wrap(self, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        # With authentication on, the body is parsed only after the caller is known.
        parse = handler.request_deserializer if self.directory is not None else None
        wire_parse = None if self.directory is not None else handler.request_deserializer
        serialize = handler.response_serializer
        refused = self._refusal
        drain = self.drain

        def parsed(raw: Any) -> Any:
            return parse(raw) if parse is not None else raw

        if handler.unary_unary is not None:
            unary: Any = handler.unary_unary

            async def call_unary(raw: Any, context: Context) -> Any:
                refusal = refused(context)
                if refusal is not None:
                    await reject(context, refusal)
                try:
                    # `parsed`, spelled out: one frame less on every call
                    return await unary(raw if parse is None else parse(raw), context)
                finally:
                    drain.leave()

            return grpc.unary_unary_rpc_method_handler(call_unary, wire_parse, serialize)
        if handler.unary_stream is not None:
            stream: Any = handler.unary_stream

            async def call_stream(raw: Any, context: Context) -> AsyncIterator[Any]:
                refusal = refused(context)
                if refusal is not None:
                    await reject(context, refusal)
                try:
                    # aclosing: a dropped stream closes the handler's generator here, at once.
                    async with aclosing(stream(raw if parse is None else parse(raw), context)) as items:
                        async for item in items:
                            yield item
                finally:
                    drain.leave()

            return grpc.unary_stream_rpc_method_handler(call_stream, wire_parse, serialize)

        async def each_parsed(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for raw in requests:
                yield parsed(raw)

        if handler.stream_unary is not None:
            upload: Any = handler.stream_unary

            async def call_upload(requests: AsyncIterator[Any], context: Context) -> Any:
                refusal = refused(context)
                if refusal is not None:
                    await reject(context, refusal)
                try:
                    return await upload(each_parsed(requests), context)
                finally:
                    drain.leave()

            return grpc.stream_unary_rpc_method_handler(call_upload, wire_parse, serialize)
        both: Any = handler.stream_stream

        async def call_both(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            refusal = refused(context)
            if refusal is not None:
                await reject(context, refusal)
            try:
                async with aclosing(both(each_parsed(requests), context)) as items:
                    async for item in items:
                        yield item
            finally:
                drain.leave()

        return grpc.stream_stream_rpc_method_handler(call_both, wire_parse, serialize)
