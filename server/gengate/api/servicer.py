"""The gRPC servicer: converts, calls the core, maps errors. No business logic lives here."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import grpc
from gengate_proto.v1 import generation_pb2 as gpb
from gengate_proto.v1 import generation_pb2_grpc

from gengate.api import convert
from gengate.api.coalesce import coalesced
from gengate.api.status import abort, to_rpc_status
from gengate.domain import GenerationRequest
from gengate.errors import GengateError, Internal, brief
from gengate.logs import log_unexpected
from gengate.service import INLINE_REQUEST_BYTES, GenerationCore

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[object, object]


def _deadline(context: Context, default_timeout_s: float | None) -> float | None:
    """The caller's deadline, else the server's default request timeout, as time.monotonic()."""
    left = context.time_remaining()
    if left is None:
        left = default_timeout_s
    return None if left is None else time.monotonic() + left


def _unexpected(exc: Exception) -> Internal:
    log_unexpected(log, exc, "unexpected error")
    return Internal(f"unexpected server error: {type(exc).__name__}", reason="UNEXPECTED")


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """gengate.v1.GenerationService over the GenerationCore."""

    def __init__(self, core: GenerationCore, *, default_timeout_s: float | None = None) -> None:
        self.core = core
        self.default_timeout_s = default_timeout_s

    async def _to_domain(
        self, message: gpb.GenerateRequest, deadline: float | None, prefix: str = ""
    ) -> GenerationRequest:
        """Converts a request; a large one in a thread, so nothing that scales with the input runs
        on the event loop (the core checks it off the loop too: GenerationRequest.wire_bytes)."""
        size = WIRE_BYTES.get()
        if size <= INLINE_REQUEST_BYTES:
            return self._convert(message, deadline, prefix, size)
        return await asyncio.to_thread(self._convert, message, deadline, prefix, size)

    def _convert(
        self, message: gpb.GenerateRequest, deadline: float | None, prefix: str, size: int
    ) -> GenerationRequest:
        return convert.request_from_pb(
            message,
            deadline=deadline,
            prefix=prefix,
            max_schema_json_bytes=self.core.limits.max_constraint_bytes,
            wire_bytes=size,
        )

    async def _converted(
        self, operation: str, message: gpb.GenerateRequest, deadline: float | None, prefix: str = ""
    ) -> GenerationRequest:
        """`_to_domain`, a request that cannot be converted told to the core's observer."""
        began = time.monotonic()
        try:
            return await self._to_domain(message, deadline, prefix)
        except GengateError as exc:
            self.core.refused(operation, message.model, exc, time.monotonic() - began)
            raise

    async def Generate(self, request: gpb.GenerateRequest, context: Context) -> gpb.GenerateResponse:
        try:
            domain_request = await self._converted(
                "generate", request, _deadline(context, self.default_timeout_s)
            )
            result = await self.core.generate(domain_request)
            return convert.result_to_pb(result)
        except GengateError as exc:
            await abort(context, exc)
        except Exception as exc:
            await abort(context, _unexpected(exc))
        raise AssertionError("unreachable")  # abort() raises

    async def GenerateStream(
        self, request: gpb.GenerateStreamRequest, context: Context
    ) -> AsyncIterator[gpb.GenerateStreamResponse]:
        try:
            domain_request = await self._converted(
                "generate_stream", request.request, _deadline(context, self.default_timeout_s), "request."
            )
            try:
                # aclosing: a call cancelled mid-write stops the reader and its source now, here
                async with aclosing(coalesced(self.core.generate_stream(domain_request))) as events:
                    async for event in events:
                        yield convert.event_to_pb(event)
            except GengateError as exc:
                raise exc.under("request.") from None
        except GengateError as exc:
            await abort(context, exc)
        except Exception as exc:
            await abort(context, _unexpected(exc))

    async def BatchGenerate(
        self, request: gpb.BatchGenerateRequest, context: Context
    ) -> AsyncIterator[gpb.BatchGenerateResponse]:
        try:
            self.core.check_batch_size(len(request.requests))
            deadline = _deadline(context, self.default_timeout_s)
            if WIRE_BYTES.get() <= INLINE_REQUEST_BYTES:
                items, failed = self._batch_items(request, deadline, small=True)
            else:
                items, failed = await asyncio.to_thread(self._batch_items, request, deadline, small=False)
            for i, item_error in failed:
                self.core.refused("batch_generate", request.requests[i].model, item_error, 0.0)
                yield gpb.BatchGenerateResponse(index=i, error=to_rpc_status(item_error))
            if not items:
                if not failed:
                    raise _empty_batch()
                return
            positions = [i for i, _ in items]
            async for position, outcome in self.core.batch([r for _, r in items]):
                index = positions[position]
                if isinstance(outcome, GengateError):
                    error = outcome.under(f"requests[{index}].")
                    yield gpb.BatchGenerateResponse(index=index, error=to_rpc_status(error))
                else:
                    yield gpb.BatchGenerateResponse(index=index, response=convert.result_to_pb(outcome))
        except GengateError as exc:
            await abort(context, exc)
        except Exception as exc:
            await abort(context, _unexpected(exc))

    def _batch_items(
        self, request: gpb.BatchGenerateRequest, deadline: float | None, *, small: bool
    ) -> tuple[list[tuple[int, GenerationRequest]], list[tuple[int, GengateError]]]:
        """Each item converted; the ones that cannot be answer as their own item. Items of a
        small batch are small; those of a large one are measured (in this, a worker thread)."""
        items: list[tuple[int, GenerationRequest]] = []
        failed: list[tuple[int, GengateError]] = []
        for i, item in enumerate(request.requests):
            prefix = f"requests[{i}]."
            try:
                size = 0 if small else item.ByteSize()
                items.append((i, self._convert(item, deadline, prefix, size)))
            except GengateError as bad_item:
                failed.append((i, bad_item))
        return items, failed

    async def ListModels(self, request: gpb.ListModelsRequest, context: Context) -> gpb.ListModelsResponse:
        return gpb.ListModelsResponse(models=[convert.model_info_to_pb(m) for m in self.core.list_models()])


class MalformedRequest:
    """What the safe deserializer returns for bytes that are not a valid request message."""

    __slots__ = ("problem",)

    def __init__(self, problem: str) -> None:
        self.problem = problem


# Serialized sizes of requests just parsed, by id of the parsed message, until their handler
# starts (message.ByteSize() would cost 65 ms of held GIL on a 45 MB request; len(data) is free).
_parsed_sizes: dict[int, int] = {}
_MAX_PARSED_SIZES = 10_000
WIRE_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("gengate_wire_bytes", default=0)


def _safe_deserializer(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            message = parse(data)
        except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, nesting too deep
            return MalformedRequest(brief(str(exc)) or type(exc).__name__)
        if len(_parsed_sizes) > _MAX_PARSED_SIZES:  # handlers that never started (cancelled calls)
            _parsed_sizes.clear()
        _parsed_sizes[id(message)] = len(data)
        return message

    return deserialize


def _received(request: Any) -> None:
    """Makes the request's serialized size known to the handler (WIRE_BYTES)."""
    WIRE_BYTES.set(_parsed_sizes.pop(id(request), 0))


def _malformed(request: MalformedRequest) -> GengateError:
    from gengate.errors import InvalidArgument

    return InvalidArgument(
        f"the request is not a valid protobuf message of this method: {request.problem}",
        reason="MALFORMED_REQUEST",
    )


def _guarded(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """The handler with a deserializer that never raises; malformed bytes end the call with
    INVALID_ARGUMENT and ErrorInfo instead of grpc's bare UNKNOWN."""
    assert handler.request_deserializer is not None
    deserializer = _safe_deserializer(handler.request_deserializer)
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def call(request: Any, context: Context) -> Any:
            if isinstance(request, MalformedRequest):
                await abort(context, _malformed(request))
            _received(request)
            return await unary(request, context)  # type: ignore[arg-type]

        return handler._replace(request_deserializer=deserializer, unary_unary=call)  # type: ignore[attr-defined,no-any-return]
    if handler.stream_unary is not None:
        upload = handler.stream_unary

        async def call_upload(requests: AsyncIterator[Any], context: Context) -> Any:
            async def checked() -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, MalformedRequest):
                        await abort(context, _malformed(request))
                    yield request

            return await upload(checked(), context)  # type: ignore[arg-type]

        return handler._replace(request_deserializer=deserializer, stream_unary=call_upload)  # type: ignore[attr-defined,no-any-return]
    assert handler.unary_stream is not None
    stream = handler.unary_stream

    async def call_stream(request: Any, context: Context) -> AsyncIterator[Any]:
        if isinstance(request, MalformedRequest):
            await abort(context, _malformed(request))
        _received(request)
        produced: Any = stream(request, context)  # type: ignore[arg-type]
        async with aclosing(produced) as items:
            async for item in items:
                yield item

    return handler._replace(request_deserializer=deserializer, unary_stream=call_stream)  # type: ignore[attr-defined,no-any-return]


class _HandlerCapture:
    """Stands in for a server to collect the generated code's method handlers."""

    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.handlers = handlers


def add_to_server(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Registers the service as the generated code does, every method behind a safe deserializer."""
    add_guarded(server, generation_pb2_grpc.add_GenerationServiceServicer_to_server, servicer,
                gpb.DESCRIPTOR.services_by_name["GenerationService"].full_name)  # fmt: skip


def add_guarded(
    server: grpc.aio.Server, add: Callable[[Any, Any], None], servicer: object, service: str
) -> None:
    """Registers `servicer` with the generated `add_...Servicer_to_server` function `add`, each
    method behind a deserializer that never raises (malformed bytes: INVALID_ARGUMENT)."""
    capture = _HandlerCapture()
    add(servicer, capture)
    handlers = {name: _guarded(handler) for name, handler in capture.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def _empty_batch() -> GengateError:
    from gengate.errors import InvalidArgument

    return InvalidArgument.field("requests", "must contain at least one request")
