"""Errors every layer raises; the api layer maps them to gRPC status codes with google.rpc details.

A backend or the router raises one of these with a machine-readable `reason` (ErrorInfo) and,
for bad input, the offending fields. Nothing below the api layer knows about gRPC.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass


class StatusCode(enum.StrEnum):
    """The gRPC codes gengate uses, by name (mapped to grpc.StatusCode in api/status.py)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    INTERNAL = "INTERNAL"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request: `field` is a dotted proto path such as `sampling.temperature`."""

    field: str
    description: str


class GengateError(Exception):
    """Base error: a status code, a reason, a message and optional details."""

    code: StatusCode = StatusCode.INTERNAL
    default_reason: str = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        violations: tuple[FieldViolation, ...] | list[FieldViolation] = (),
        retry_after_s: float | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.violations = tuple(violations)
        self.retry_after_s = retry_after_s
        self.metadata = dict(metadata or {})

    def under(self, prefix: str) -> GengateError:
        """This error with its field paths placed under `prefix` ("requests[3]." for a batch item):
        BadRequest paths are relative to the whole RPC request (AIP-193), and a message that
        starts with a field's name (`InvalidArgument.field`) names the same path."""
        if not self.violations or not prefix:
            return self
        moved = copy.copy(self)
        moved.violations = tuple(FieldViolation(prefix + v.field, v.description) for v in self.violations)
        if any(self.message.startswith(f"{v.field}: ") for v in self.violations):
            moved.message = prefix + self.message
            moved.args = (moved.message,)
        return moved


class InvalidArgument(GengateError):
    code = StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"

    @classmethod
    def field(cls, field: str, description: str, *, reason: str = "INVALID_FIELD") -> InvalidArgument:
        """A one-field error whose message names the field."""
        return cls(f"{field}: {description}", reason=reason, violations=[FieldViolation(field, description)])


class NotFound(GengateError):
    code = StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class FailedPrecondition(GengateError):
    code = StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class Unimplemented(GengateError):
    code = StatusCode.UNIMPLEMENTED
    default_reason = "UNSUPPORTED"


class Unavailable(GengateError):
    code = StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class Unauthenticated(GengateError):
    """The call carries no credentials, or ones that name no caller."""

    code = StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(GengateError):
    """An authenticated caller asked for something its configuration does not allow."""

    code = StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class ResourceExhausted(GengateError):
    code = StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(GengateError):
    code = StatusCode.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"


class Cancelled(GengateError):
    code = StatusCode.CANCELLED
    default_reason = "CANCELLED"


class Aborted(GengateError):
    code = StatusCode.ABORTED
    default_reason = "ABORTED"


class Internal(GengateError):
    code = StatusCode.INTERNAL
    default_reason = "INTERNAL"


ECHO_CHARS = 200


def echo(value: str, limit: int = ECHO_CHARS) -> str:
    """A caller's value as shown in an error: quoted, and cut to `limit` characters."""
    if len(value) <= limit:
        return repr(value)
    return repr(value[:limit]) + f"... ({len(value)} characters)"


def brief(text: str, limit: int = ECHO_CHARS) -> str:
    """A library's error message in one short line: its first line, plus the line that says
    `error: ...` where the library adds one below an echo of the input. No internal state,
    traceback or whole input reaches a caller."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    head = _cut(lines[0], limit)
    reason = next((line for line in lines[1:] if line.lower().startswith("error:")), None)
    if reason is not None:
        head = f"{_cut(lines[0], limit // 2)} {_cut(reason, limit // 2)}"
    return head


def _cut(line: str, limit: int) -> str:
    return line if len(line) <= limit else line[: limit - 3] + "..."


class ConfigError(Exception):
    """The configuration file is wrong; raised at start-up with the file and key named."""
