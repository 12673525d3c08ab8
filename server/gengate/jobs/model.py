"""A batch job as the store and the runner see it, apart from protobuf (api/convert.py maps it)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from gengate.domain import GenerationRequest, GenerationResult
from gengate.errors import GengateError

# Enters the caller context of a job's owner around the work of its items (callers.context
# serving_owner); a GengateError on entering fails the item with it.
AsOwner = Callable[[str], AbstractContextManager[None]]


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class JobOptions:
    offline: bool = False
    priority: int = 0
    max_concurrency: int = 0  # 0: the server's default


@dataclass(frozen=True)
class JobUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0


@dataclass(frozen=True)
class Job:
    id: str
    display_name: str
    state: JobState
    total: int
    done: int = 0
    failed: int = 0
    create_time: float = 0.0
    start_time: float | None = None
    end_time: float | None = None
    usage: JobUsage = field(default_factory=JobUsage)
    options: JobOptions = field(default_factory=JobOptions)
    idempotency_key: str = ""
    error: str = ""
    sealed: bool = True  # False while an upload is still adding items
    owner: str = ""  # the caller who created it ("" without callers): only it sees the job


@dataclass(frozen=True)
class ItemResult:
    """One item's stored result: the encoded response or status, and whether it is an error."""

    index: int
    payload: bytes
    failed: bool
    usage: JobUsage = field(default_factory=JobUsage)


@dataclass(frozen=True)
class LeasedItem:
    """An item a runner holds: its index and its encoded request."""

    index: int
    request: bytes


class JobCodec(Protocol):
    """How items are stored: the api layer's protobuf encoding, kept out of the jobs layer."""

    def decode_request(self, data: bytes, index: int) -> GenerationRequest:
        """The item's request; a GengateError (with `requests[i].` fields) makes it that item's error."""
        ...

    def encode_result(self, result: GenerationResult) -> bytes: ...

    def encode_error(self, error: GengateError, index: int) -> bytes: ...

    def cancelled(self) -> bytes:
        """The status stored for items a cancel (or a failed job) ends."""
        ...
