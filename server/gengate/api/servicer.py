"""The gRPC servicer: converts, calls the core, maps errors. No business logic lives here."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc
from gengate_client._proto.gengate.v1 import generation_pb2 as gpb
from gengate_client._proto.gengate.v1 import generation_pb2_grpc

from gengate.api import convert
from gengate.api.status import abort, to_rpc_status
from gengate.errors import GengateError, Internal
from gengate.service import GenerationCore

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[object, object]


def _deadline(context: Context, default_timeout_s: float | None) -> float | None:
    """The caller's deadline, else the server's default request timeout, as time.monotonic()."""
    left = context.time_remaining()
    if left is None:
        left = default_timeout_s
    return None if left is None else time.monotonic() + left


def _unexpected(exc: Exception) -> Internal:
    log.exception("unexpected error")
    return Internal(f"unexpected server error: {type(exc).__name__}", reason="UNEXPECTED")


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """gengate.v1.GenerationService over the GenerationCore."""

    def __init__(self, core: GenerationCore, *, default_timeout_s: float | None = None) -> None:
        self.core = core
        self.default_timeout_s = default_timeout_s

    async def Generate(self, request: gpb.GenerateRequest, context: Context) -> gpb.GenerateResponse:
        try:
            domain_request = convert.request_from_pb(
                request, deadline=_deadline(context, self.default_timeout_s)
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
            domain_request = convert.request_from_pb(
                request.request, deadline=_deadline(context, self.default_timeout_s), prefix="request."
            )
            try:
                async for event in self.core.generate_stream(domain_request):
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
            deadline = _deadline(context, self.default_timeout_s)
            items = []
            failed: list[tuple[int, GengateError]] = []
            for i, item in enumerate(request.requests):
                try:
                    items.append(
                        (i, convert.request_from_pb(item, deadline=deadline, prefix=f"requests[{i}]."))
                    )
                except GengateError as bad_item:
                    failed.append((i, bad_item))
            for i, item_error in failed:
                yield gpb.BatchGenerateResponse(index=i, error=to_rpc_status(item_error))
            if not items:
                if not failed:
                    await abort(context, _empty_batch())
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

    async def ListModels(self, request: gpb.ListModelsRequest, context: Context) -> gpb.ListModelsResponse:
        return gpb.ListModelsResponse(models=[convert.model_info_to_pb(m) for m in self.core.list_models()])


def _empty_batch() -> GengateError:
    from gengate.errors import InvalidArgument

    return InvalidArgument.field("requests", "must contain at least one request")
