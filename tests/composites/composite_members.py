"""A controllable member backend for composite tests: fails with a chosen status code (before any
token, or after some), echoes every message it got, declares chosen capabilities, and records
the requests it received and the calls that were cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar

from gengate.backend import collect_stream
from gengate.domain import (
    ConstraintKind,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    ModelCapabilities,
    StreamEvent,
    StreamStart,
    Usage,
)
from gengate.engines.scripted import split_tokens
from gengate.errors import (
    DeadlineExceeded,
    GengateError,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from gengate.api.server import RunningServer
    from gengate.service import GenerationCore

# Fixture types of tests/composites/conftest.py (imported from here: `conftest` is ambiguous
# when several test folders are collected in one run).
CoreFactory = Callable[[list[dict[str, Any]]], Awaitable["GenerationCore"]]
ServerFactory = Callable[[list[dict[str, Any]]], Awaitable["RunningServer"]]

ERRORS: dict[str, type[GengateError]] = {
    "UNAVAILABLE": Unavailable,
    "INVALID_ARGUMENT": InvalidArgument,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "INTERNAL": Internal,
}

KIND = "test_member"
TARGET = f"{__name__}:MemberUnderTest"


class MemberOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = None  # None: echo every message (system included), or the prompt
    fail: str | None = None  # a status code name to fail with
    fail_after_deltas: int = 0  # streaming: deltas sent before failing
    latency_s: float = 0.0
    constraints: dict[str, str] = {}
    max_n: int = 8
    logprobs: bool = False
    chat: bool = True


class MemberUnderTest:
    kind: ClassVar[str] = KIND
    Options: ClassVar[type[BaseModel]] = MemberOptions

    def __init__(self, name: str, options: MemberOptions) -> None:
        self.name = name
        self.options = options
        self.capabilities = ModelCapabilities(
            constraints={ConstraintKind(k): Enforcement(v) for k, v in options.constraints.items()},
            max_n=options.max_n,
            logprobs=options.logprobs,
            max_top_logprobs=5 if options.logprobs else 0,
            chat=options.chat,
        )
        self.requests: list[GenerationRequest] = []
        self.cancelled = 0

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await collect_stream(self.generate_stream(request))

    def answer(self, request: GenerationRequest) -> str:
        if self.options.text is not None:
            return self.options.text
        if request.messages is not None:
            return "\n".join(f"[{m.role.value}] {m.text}" for m in request.messages)
        return request.prompt or ""

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        self.requests.append(request)
        try:
            if self.options.latency_s:
                await asyncio.sleep(self.options.latency_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        yield StreamStart(request_id=request.request_id, model=self.name, input_tokens=7)
        tokens = split_tokens(self.answer(request))
        if self.options.fail is not None:
            for token in tokens[: self.options.fail_after_deltas]:
                yield GenerationDelta(index=0, text=token)
            raise ERRORS[self.options.fail](f"{self.name} failed on purpose")
        for index in range(request.n):
            for token in tokens:
                yield GenerationDelta(index=index, text=token)
            yield GenerationEnd(index=index, finish_reason=FinishReason.STOP, usage=Usage(7, len(tokens)))
