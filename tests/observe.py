"""Helpers for integration tests that wait for what the server does (no wall-clock thresholds)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from gengate.api.server import RunningServer
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ServerFactory = Callable[[dict[str, Any]], Awaitable[RunningServer]]


async def until(condition: Callable[[], bool], what: str) -> None:
    """Waits for an observable event `what`; a test stuck here fails by pytest's timeout, not by
    a wall-clock threshold of its own."""
    while not condition():
        await asyncio.sleep(0.02)


def status_of(error: grpc.aio.AioRpcError | status_pb2.Status) -> status_pb2.Status:
    """The google.rpc.Status of a failed call (or the status itself, e.g. a batch item's)."""
    if isinstance(error, status_pb2.Status):
        return error
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "the error carries no google.rpc.Status"
    return status


def error_info(error: grpc.aio.AioRpcError | status_pb2.Status) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo of a failed call or of a status (an empty one when it has none)."""
    for detail in status_of(error).details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return error_details_pb2.ErrorInfo()


def reason(error: grpc.aio.AioRpcError | status_pb2.Status) -> str:
    """The ErrorInfo reason of a failed call or of a status ("" when it has none)."""
    return str(error_info(error).reason)


def field_violations(error: grpc.aio.AioRpcError | status_pb2.Status) -> list[str]:
    """The BadRequest field paths of a failed call or of a status."""
    fields: list[str] = []
    for detail in status_of(error).details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return fields
