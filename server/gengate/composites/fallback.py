"""`fallback`: one served name backed by a chain of models, tried in order when one fails.

    - name: answer
      backend: fallback
      models: [gpt, claude, tiny]       # served names, tried in this order
      on: [UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED]   # codes that move to the next
      max_attempts: 3                   # default: every model once

Capabilities are what every member can do, so any request the fallback accepts is acceptable to
whichever member answers. A next model is tried only while the caller's deadline has time left;
a stream falls back only before its first token reached the caller.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gengate.backend import Backend, aclose_stream
from gengate.composites.base import (
    CompositeBackend,
    annotate,
    common_capabilities,
    error_code,
    member_request,
)
from gengate.domain import GenerationRequest, GenerationResult, ModelCapabilities, StreamEvent, StreamStart
from gengate.errors import StatusCode

log = logging.getLogger("gengate.composites")

DEFAULT_ON = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")


class FallbackOptions(BaseModel):
    """Config keys of a `fallback` model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: list[str] = Field(min_length=2, description="Served model names, tried in order.")
    on: list[str] = Field(
        default=list(DEFAULT_ON), min_length=1, description="Status codes that move on to the next model."
    )
    max_attempts: int | None = Field(default=None, ge=1, description="Models tried at most; default all.")

    @field_validator("on")
    @classmethod
    def _known_codes(cls, value: list[str]) -> list[str]:
        codes = [c.upper() for c in value]
        unknown = sorted(set(codes) - {c.value for c in StatusCode})
        if unknown:
            raise ValueError(
                f"unknown status code(s) {unknown}; known: {sorted(c.value for c in StatusCode)}"
            )
        return codes

    def members(self) -> list[str]:
        """The served models this one calls (checked against the config's names at load)."""
        return list(self.models)

    @model_validator(mode="after")
    def _distinct(self) -> FallbackOptions:
        if len(set(self.models)) != len(self.models):
            raise ValueError("models must be distinct (each is tried once)")
        return self


class FallbackBackend(CompositeBackend):
    """Tries each member in order; moves on only for the configured error codes."""

    kind: ClassVar[str] = "fallback"
    Options: ClassVar[type[BaseModel]] = FallbackOptions

    def __init__(self, name: str, options: FallbackOptions) -> None:
        super().__init__(name)
        self.options = options
        self._on = frozenset(options.on)

    def member_names(self) -> list[str]:
        return self.options.members()

    def derive_capabilities(self) -> ModelCapabilities:
        return common_capabilities([self.member(m).capabilities for m in self.options.models])

    def _chain(self) -> list[Backend]:
        return [self.member(m) for m in self.options.models[: self.options.max_attempts]]

    def _moves_on(self, exc: Exception, member: Backend, attempt: int, request: GenerationRequest) -> bool:
        """Whether a failure of `member` hands the request to the next one."""
        code = error_code(exc)
        if code not in self._on:
            return False
        left = request.time_left()
        if attempt + 1 >= len(self._chain()) or (left is not None and left <= 0):
            return False
        log.warning(
            "fallback %s: %s failed with %s (%s); trying the next model",
            self.name,
            member.name,
            code,
            type(exc).__name__,
        )
        return True

    def _answered(self, member: Backend, attempt: int) -> None:
        annotate("gengate.fallback.member", member.name)
        annotate("gengate.fallback.attempts", attempt + 1)
        if attempt:
            log.info("fallback %s: answered by %s (attempt %d)", self.name, member.name, attempt + 1)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        began = time.monotonic()
        for attempt, member in enumerate(self._chain()):
            try:
                result = await member.generate(member_request(member, request, f"f{attempt}"))
            except Exception as exc:
                if self._moves_on(exc, member, attempt, request):
                    continue
                raise
            self._answered(member, attempt)
            timings = result.timings
            if attempt and timings.time_to_first_token_s is not None:
                # The time spent on failed members is part of the caller's wait.
                timings = timings.later(time.monotonic() - began - (timings.total_s or 0.0))
            return dataclasses.replace(
                result, request_id=request.request_id, model=self.name, timings=timings
            )
        raise AssertionError("unreachable: the last attempt either returns or raises")

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        for attempt, member in enumerate(self._chain()):
            stream = member.generate_stream(member_request(member, request, f"f{attempt}"))
            start: StreamStart | None = None
            committed = False  # once an event past the start reached the caller, errors propagate
            try:
                async for event in stream:
                    if not committed:
                        if isinstance(event, StreamStart):
                            start = event
                            continue
                        committed = True
                        self._answered(member, attempt)
                        yield self._start(start, request)
                    yield event
                if not committed:
                    self._answered(member, attempt)
                    yield self._start(start, request)
                return
            except Exception as exc:
                if committed or not self._moves_on(exc, member, attempt, request):
                    raise
            finally:
                await aclose_stream(stream)

    def _start(self, start: StreamStart | None, request: GenerationRequest) -> StreamStart:
        if start is None:
            raise RuntimeError(f"a member of {self.name!r} streamed before its start event")
        return dataclasses.replace(start, request_id=request.request_id, model=self.name)
