"""GengateError → gRPC status with google.rpc details (ErrorInfo, BadRequest, RetryInfo)."""

from __future__ import annotations

import asyncio
import logging
import math

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from gengate.errors import GengateError, StatusCode
from gengate.redaction import redact

log = logging.getLogger(__name__)
# Within this much of the caller's deadline, gRPC is left to end the call itself.
DEADLINE_RACE_MARGIN_S = 0.01

ERROR_DOMAIN = "gengate.dev"

GRPC_CODES: dict[StatusCode, grpc.StatusCode] = {
    code: getattr(grpc.StatusCode, code.value) for code in StatusCode
}


# Sizes of what an error may carry, so that every status stays far under the 8 KB of trailers a
# stock client accepts (grpc's default max metadata size), whatever the request echoed.
MAX_MESSAGE_CHARS = 1024
MAX_VIOLATIONS = 16
MAX_FIELD_CHARS = 200
MAX_DESCRIPTION_CHARS = 300
MAX_METADATA_ENTRIES = 8
MAX_METADATA_CHARS = 200


def _cut(text: str, limit: int) -> str:
    text = redact(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_rpc_status(error: GengateError) -> status_pb2.Status:
    """The google.rpc.Status for an error: used for RPC trailers and per-item batch errors.

    Secrets are redacted and every text is cut, so what a caller sent is never echoed whole.
    """
    details: list[any_pb2.Any] = []
    metadata = {
        _cut(k, 64): _cut(v, MAX_METADATA_CHARS)
        for k, v in list(error.metadata.items())[:MAX_METADATA_ENTRIES]
    }
    info = error_details_pb2.ErrorInfo(reason=_cut(error.reason, 64), domain=ERROR_DOMAIN, metadata=metadata)
    details.append(_pack(info))
    if error.violations:
        shown = error.violations[:MAX_VIOLATIONS]
        violations = [
            error_details_pb2.BadRequest.FieldViolation(
                field=_cut(v.field, MAX_FIELD_CHARS), description=_cut(v.description, MAX_DESCRIPTION_CHARS)
            )
            for v in shown
        ]
        if len(error.violations) > len(shown):
            violations.append(
                error_details_pb2.BadRequest.FieldViolation(
                    field="", description=f"and {len(error.violations) - len(shown)} more violations"
                )
            )
        details.append(_pack(error_details_pb2.BadRequest(field_violations=violations)))
    if error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(
        code=getattr(code_pb2, error.code.value), message=status_message(error), details=details
    )


def status_message(error: GengateError) -> str:
    """The status message as sent: secrets redacted, cut to MAX_MESSAGE_CHARS."""
    return _cut(error.message, MAX_MESSAGE_CHARS)


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
        log.warning("%s: %s (%s)", error.code.value, status.message, error.reason)
    metadata: tuple[tuple[str, str | bytes], ...] = trailing_metadata(status)
    if error.retry_after_s is not None:
        metadata += retry_metadata(error.retry_after_s)
    context.set_trailing_metadata(metadata)
    await context.abort(GRPC_CODES[error.code], status.message)
