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


# Sizes (UTF-8 bytes) of what an error may carry, so that every status stays under the 8 KB of
# trailers a stock client accepts (grpc's default max metadata size) whatever the request echoed:
# the message travels twice (grpc-message, percent-encoded: up to 3x; and inside the status,
# base64: 4/3x), so the message is kept to 600 bytes and the whole status to 3,000.
MAX_MESSAGE_BYTES = 600
MAX_STATUS_BYTES = 3000
MAX_VIOLATIONS = 16
MAX_FIELD_BYTES = 200
MAX_DESCRIPTION_BYTES = 300
MAX_METADATA_ENTRIES = 8
MAX_METADATA_BYTES = 200
MAX_RETRY_AFTER_S = 3600.0
# The longest wait a client's own gRPC retry is told to take (gRFC A6 pushback): a longer RetryInfo
# delay, or one the caller's deadline would not outlast, is pushback -1 ("do not retry"), so the
# caller gets the error and its RetryInfo at once instead of a silent wait or a DEADLINE_EXCEEDED.
MAX_PUSHBACK_S = 10.0


def _cut(text: str, limit: int) -> str:
    """`text` redacted, then cut to `limit` UTF-8 bytes (on a character boundary)."""
    text = redact(text)
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", "ignore") + "..."


def to_rpc_status(error: GengateError) -> status_pb2.Status:
    """The google.rpc.Status for an error: used for RPC trailers and per-item batch errors.

    Secrets are redacted and every text is cut, so what a caller sent is never echoed whole;
    field violations past the status budget are summarised as a count.
    """
    details: list[any_pb2.Any] = []
    entries = list(error.metadata.items())[:MAX_METADATA_ENTRIES]
    metadata = {_cut(k, 64): _cut(v, MAX_METADATA_BYTES) for k, v in entries}
    info = error_details_pb2.ErrorInfo(reason=_cut(error.reason, 64), domain=ERROR_DOMAIN, metadata=metadata)
    details.append(_pack(info))
    retry = _retry_info(error.retry_after_s)
    if retry is not None:
        details.append(_pack(retry))
    status = status_pb2.Status(code=getattr(code_pb2, error.code.value), message=status_message(error))
    status.details.extend(details)
    if error.violations:
        status.details.append(_pack(_bad_request(error, MAX_STATUS_BYTES - status.ByteSize())))
    return status


def _bad_request(error: GengateError, budget: int) -> error_details_pb2.BadRequest:
    """The field violations that fit in `budget` bytes, then one saying how many were left out."""
    bad = error_details_pb2.BadRequest()
    for v in error.violations[:MAX_VIOLATIONS]:
        item = error_details_pb2.BadRequest.FieldViolation(
            field=_cut(v.field, MAX_FIELD_BYTES), description=_cut(v.description, MAX_DESCRIPTION_BYTES)
        )
        if bad.ByteSize() + item.ByteSize() + 64 > budget:
            break
        bad.field_violations.append(item)
    left = len(error.violations) - len(bad.field_violations)
    if left:
        bad.field_violations.append(
            error_details_pb2.BadRequest.FieldViolation(field="", description=f"and {left} more violations")
        )
    return bad


def _retry_info(retry_after_s: float | None) -> error_details_pb2.RetryInfo | None:
    if retry_after_s is None or math.isnan(retry_after_s):
        return None
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(_bounded_delay(retry_after_s) * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


def _bounded_delay(seconds: float) -> float:
    """A retry delay within [0, MAX_RETRY_AFTER_S] (an upstream may say `Retry-After: inf`)."""
    if math.isnan(seconds):
        return 0.0
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def status_message(error: GengateError) -> str:
    """The status message as sent: secrets redacted, cut to MAX_MESSAGE_BYTES."""
    return _cut(error.message, MAX_MESSAGE_BYTES)


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def trailing_metadata(status: status_pb2.Status) -> tuple[tuple[str, bytes], ...]:
    """The `grpc-status-details-bin` trailer clients decode with grpc_status.rpc_status."""
    return (("grpc-status-details-bin", status.SerializeToString()),)


def retry_metadata(
    retry_after_s: float, time_remaining_s: float | None = None
) -> tuple[tuple[str, str], ...]:
    """RetryInfo's delay where proxies and gRPC's own retries read it: `retry-after` (whole
    seconds, Envoy's rate-limited back-off) and `grpc-retry-pushback-ms` (gRFC A6) — `-1`, which
    stops a client's automatic retry, when the delay is past MAX_PUSHBACK_S or would outlast the
    caller's remaining deadline (`time_remaining_s`)."""
    delay = _bounded_delay(retry_after_s)
    too_long = delay > MAX_PUSHBACK_S or (time_remaining_s is not None and delay >= time_remaining_s)
    return (
        ("retry-after", str(max(1, math.ceil(delay)))),
        ("grpc-retry-pushback-ms", "-1" if too_long else str(max(0, round(delay * 1000)))),
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
        metadata += retry_metadata(error.retry_after_s, context.time_remaining())
    context.set_trailing_metadata(metadata)
    await context.abort(GRPC_CODES[error.code], status.message)
