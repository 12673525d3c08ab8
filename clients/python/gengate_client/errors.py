"""Errors raised by the client: RPC failures decoded from `google.rpc.Status` details, and
problems with a structured result (cut short, or not parseable into the requested type).

Every RPC error is a `GengateError` whose subclass follows the gRPC status code, so callers can
`except NotFoundError` or `except GengateError as e: e.retry_after`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import error_details_pb2, status_pb2

if TYPE_CHECKING:
    from gengate_client.types import Response

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class FieldViolation:
    """One bad request field, as the server named it (a dotted path such as `sampling.top_p`)."""

    field: str
    description: str


class GengateError(Exception):
    """A failed call: its gRPC code, message and the server's structured details."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str | None = None,
        domain: str | None = None,
        metadata: dict[str, str] | None = None,
        field_violations: Iterable[FieldViolation] = (),
        retry_after: float | None = None,
        details: Iterable[Any] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.domain = domain
        self.metadata = dict(metadata or {})
        self.field_violations = tuple(field_violations)
        self.retry_after = retry_after
        self.details = tuple(details)

    @property
    def code_name(self) -> str:
        """The status code's name, e.g. `INVALID_ARGUMENT`."""
        return str(self.code.name)

    def __str__(self) -> str:
        text = f"{self.code_name}: {self.message}"
        if self.reason:
            text += f" (reason {self.reason})"
        return text

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code_name}, {self.message!r}, reason={self.reason!r})"


class InvalidArgumentError(GengateError):
    """The request is malformed or asks for something out of range (see `field_violations`)."""


class NotFoundError(GengateError):
    """No such model (or other named resource) is served."""


class UnimplementedError(GengateError):
    """The model cannot do what was asked (e.g. a constraint kind it does not serve)."""


class UnavailableError(GengateError):
    """The backend or server is down or restarting; retrying later may succeed."""


class ResourceExhaustedError(GengateError):
    """A rate limit or queue is full; `retry_after` says when to come back, if known."""


class DeadlineExceededError(GengateError):
    """The call's deadline expired before it finished."""


class CancelledCallError(GengateError):
    """The call was cancelled."""


class FailedPreconditionError(GengateError):
    """The server is not in a state to run the call."""


class AbortedError(GengateError):
    """The call was aborted, typically by a concurrency conflict."""


class InternalError(GengateError):
    """The server failed in a way that is not the caller's fault."""


class UnauthenticatedError(GengateError):
    """The call's credentials are missing or wrong."""


class PermissionDeniedError(GengateError):
    """The caller may not do this."""


_BY_CODE: dict[grpc.StatusCode, type[GengateError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledCallError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}
_CODE_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def error_from_status(status: status_pb2.Status, *, code: grpc.StatusCode | None = None) -> GengateError:
    """Builds the typed error for a `google.rpc.Status` (a failed call or a failed batch item)."""
    code = code or _CODE_BY_VALUE.get(status.code, grpc.StatusCode.UNKNOWN)
    reason: str | None = None
    domain: str | None = None
    metadata: dict[str, str] = {}
    violations: list[FieldViolation] = []
    retry_after: float | None = None
    details: list[Any] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, domain, metadata = info.reason or None, info.domain or None, dict(info.metadata)
            details.append(info)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend(FieldViolation(v.field, v.description) for v in bad.field_violations)
            details.append(bad)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after = retry.retry_delay.ToTimedelta().total_seconds()
            details.append(retry)
        else:
            details.append(detail)
    cls = _BY_CODE.get(code, GengateError)
    return cls(
        code,
        status.message,
        reason=reason,
        domain=domain,
        metadata=metadata,
        field_violations=violations,
        retry_after=retry_after,
        details=details,
    )


def error_from_rpc(error: grpc.RpcError) -> GengateError:
    """Decodes a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`) into a typed error."""
    code_fn = getattr(error, "code", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details_fn = getattr(error, "details", None)
    message = (details_fn() if callable(details_fn) else None) or ""
    trailing_fn = getattr(error, "trailing_metadata", None)
    trailing = (trailing_fn() if callable(trailing_fn) else None) or ()
    for key, value in trailing:
        if key == _STATUS_DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            if not status.message:
                status.message = message
            return error_from_status(status, code=code)
    return error_from_status(status_pb2.Status(code=code.value[0], message=message), code=code)


class OutputError(Exception):
    """A call succeeded but its structured result cannot be turned into the requested type."""

    def __init__(self, message: str, *, text: str, response: Response | None = None) -> None:
        super().__init__(message)
        self.text = text
        self.response = response


class TruncatedOutputError(OutputError):
    """The generation hit max_tokens (finish reason LENGTH) before the structure was complete."""


class OutputValidationError(OutputError):
    """The text did not parse or validate as the requested type."""
