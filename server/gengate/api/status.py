"""GengateError → gRPC status with google.rpc details (ErrorInfo, BadRequest, RetryInfo)."""

from __future__ import annotations

import asyncio
import logging
import math

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from gengate.errors import GengateError, StatusCode

log = logging.getLogger(__name__)
# Within this much of the caller's deadline, gRPC is left to end the call itself.
DEADLINE_RACE_MARGIN_S = 0.01

ERROR_DOMAIN = "gengate.dev"

GRPC_CODES: dict[StatusCode, grpc.StatusCode] = {
    code: getattr(grpc.StatusCode, code.value) for code in StatusCode
}


def to_rpc_status(error: GengateError) -> status_pb2.Status:
    """The google.rpc.Status for an error: used for RPC trailers and per-item batch errors."""
    details: list[any_pb2.Any] = []
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata)
    details.append(_pack(info))
    if error.violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in error.violations
            ]
        )
        details.append(_pack(bad))
    if error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(code=getattr(code_pb2, error.code.value), message=error.message, details=details)


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def trailing_metadata(status: status_pb2.Status) -> tuple[tuple[str, bytes], ...]:
    """The `grpc-status-details-bin` trailer clients decode with grpc_status.rpc_status."""
    return (("grpc-status-details-bin", status.SerializeToString()),)


def retry_metadata(retry_after_s: float) -> tuple[tuple[str, str], ...]:
    """RetryInfo's delay where proxies and gRPC's own retries read it: `retry-after` (whole
    seconds, Envoy's rate-limited back-off) and `grpc-retry-pushback-ms` (gRFC A6)."""
    return (
        ("retry-after", str(max(1, math.ceil(retry_after_s)))),
        ("grpc-retry-pushback-ms", str(max(0, round(retry_after_s * 1000)))),
    )


async def abort(context: grpc.aio.ServicerContext[object, object], error: GengateError) -> None:
    """Ends the RPC with the error's code, message and details."""
    if error.code is StatusCode.DEADLINE_EXCEEDED:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_RACE_MARGIN_S:
            # The caller's own deadline: gRPC ends the call with DEADLINE_EXCEEDED by itself, and a
            # status sent now races it (grpc logged ExecuteBatchError for ~1 in 200 such calls).
            raise asyncio.CancelledError
    status = to_rpc_status(error)
    if error.code in (StatusCode.INTERNAL, StatusCode.UNAVAILABLE):
        log.warning("%s: %s (%s)", error.code.value, error.message, error.reason)
    metadata: tuple[tuple[str, str | bytes], ...] = trailing_metadata(status)
    if error.retry_after_s is not None:
        metadata += retry_metadata(error.retry_after_s)
    context.set_trailing_metadata(metadata)
    await context.abort(GRPC_CODES[error.code], error.message)
