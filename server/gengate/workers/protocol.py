"""Typed IPC between the server and an engine worker: frozen dataclasses, pickled, length-prefixed.

Both ends are this package talking over a private socketpair, so pickle of the domain
dataclasses is safe and cheap. Each frame is a 4-byte big-endian length and a pickled list of
messages; the worker batches what it has to say within one event-loop tick into one frame.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from gengate import errors
from gengate.domain import GenerationRequest, GenerationResult, ModelCapabilities, StreamEvent
from gengate.observation import CallNotes

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 512 << 20


# server -> worker


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker loads: the backend class ("module:Class") and its options as plain data."""

    name: str
    kind: str
    target: str
    options: dict[str, Any]
    log_level: str = "WARNING"
    log_format: Literal["text", "json"] = "text"  # the server's (gengate.logs)


@dataclass(frozen=True)
class Call:
    """Run one request; `stream` says whether events or one result come back."""

    call_id: int
    request: GenerationRequest
    stream: bool


@dataclass(frozen=True)
class Abort:
    """Stop call `call_id` (cancel or deadline): the worker cancels the engine's generator."""

    call_id: int


@dataclass(frozen=True)
class Ping:
    """Asks the worker how many calls it is running; answered with Pong."""

    ping_id: int


@dataclass(frozen=True)
class Shutdown:
    """Close the engine and exit."""


# worker -> server


@dataclass(frozen=True)
class Ready:
    """The model is loaded; the worker serves with these capabilities."""

    pid: int
    capabilities: ModelCapabilities


@dataclass(frozen=True)
class StartFailed:
    """Loading failed; the worker exits after sending this."""

    message: str
    traceback: str


@dataclass(frozen=True)
class Event:
    call_id: int
    event: StreamEvent


@dataclass(frozen=True)
class Done:
    """Call finished; `result` is set for unary calls. `notes`: what the engine noted of the call
    for its metrics (compile cache, re-samples), when anything."""

    call_id: int
    result: GenerationResult | None = None
    notes: CallNotes | None = None


@dataclass(frozen=True)
class ErrorPayload:
    """A GengateError as data, rebuilt on the server side with its class and details."""

    error_class: str
    message: str
    reason: str
    violations: tuple[errors.FieldViolation, ...] = ()
    retry_after_s: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorPayload:
        if isinstance(exc, errors.GengateError):
            return cls(
                type(exc).__name__, exc.message, exc.reason, exc.violations, exc.retry_after_s, exc.metadata
            )
        return cls("Internal", f"engine error: {type(exc).__name__}: {exc}", "ENGINE_ERROR")

    def to_exception(self) -> errors.GengateError:
        error_type = getattr(errors, self.error_class, errors.Internal)
        if not (isinstance(error_type, type) and issubclass(error_type, errors.GengateError)):
            error_type = errors.Internal
        return error_type(
            self.message,
            reason=self.reason,
            violations=self.violations,
            retry_after_s=self.retry_after_s,
            metadata=self.metadata,
        )


@dataclass(frozen=True)
class Failed:
    call_id: int
    error: ErrorPayload
    notes: CallNotes | None = None


@dataclass(frozen=True)
class Aborted:
    """Call `call_id` was aborted and the engine has let go of it (its generator is closed)."""

    call_id: int


@dataclass(frozen=True)
class Pong:
    ping_id: int
    in_flight: int


ToWorker: TypeAlias = WorkerSpec | Call | Abort | Ping | Shutdown
FromWorker: TypeAlias = Ready | StartFailed | Event | Done | Failed | Aborted | Pong


def encode(messages: list[Any]) -> bytes:
    """One frame holding `messages`."""
    payload = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> list[Any]:
    """The next frame's messages; raises asyncio.IncompleteReadError at EOF (peer gone)."""
    header = await reader.readexactly(HEADER.size)
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"IPC frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    messages = pickle.loads(await reader.readexactly(size))
    if not isinstance(messages, list):
        raise ValueError("IPC frame does not hold a message list")
    return messages
