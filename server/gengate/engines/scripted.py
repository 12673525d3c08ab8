"""A model-free backend: answers configured text (or echoes the prompt) at a set latency and
token rate. For users' own tests and for measuring the service's overhead; it enforces no
constraint, and its capabilities say so."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from gengate.backend import collect_stream
from gengate.domain import (
    ConstraintKind,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    GrammarSyntax,
    ModelCapabilities,
    StreamEvent,
    StreamStart,
    Timings,
    Usage,
)
from gengate.errors import ResourceExhausted, Unavailable

_TOKEN = re.compile(r"\s*\S+|\s+")

# Scripted models of this process by name, so a probe model can read another's counters.
_LIVE: weakref.WeakValueDictionary[str, ScriptedBackend] = weakref.WeakValueDictionary()


class ScriptedOptions(BaseModel):
    """Config keys of a `scripted` model."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(default=None, description="Answer text; the prompt is echoed when unset.")
    latency_s: float = Field(default=0.0, ge=0, description="Delay before the first token.")
    tokens_per_s: float | None = Field(default=None, gt=0, description="Token rate; unset = instant.")
    max_n: int = Field(default=16, ge=1)
    fail_after_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Fail with UNAVAILABLE after this many tokens (a fault for testing error paths).",
    )
    fail_with: Literal["unavailable", "unexpected"] = Field(
        default="unavailable",
        description=(
            "What fail_after_tokens raises: UNAVAILABLE, or an exception gengate does not know (as a "
            "bug in a backend would), which the server must answer as INTERNAL UNEXPECTED."
        ),
    )
    rate_limit_every: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Refuse the first of every N calls (calls 1, N+1, 2N+1, ...; 1: every call) with "
            "RESOURCE_EXHAUSTED and RetryInfo `rate_limit_retry_after_s`, serving the others: a fault "
            "for testing clients' retries."
        ),
    )
    rate_limit_retry_after_s: float = Field(default=0.05, ge=0, description="RetryInfo of rate_limit_every.")
    answer_calls_of: str | None = Field(
        default=None,
        description=(
            "Answer the number of calls the named scripted model (same server) has received, refused "
            "ones included: a probe through which clients in any language can count their attempts."
        ),
    )
    answer_cancellations_of: str | None = Field(
        default=None,
        description=(
            "Answer the number of generations the named scripted model (same server) has abandoned "
            "so far: a probe through which clients in any language can see that the server aborted."
        ),
    )
    constraints: dict[ConstraintKind, Enforcement] = Field(
        default_factory=dict,
        description=(
            "Constraint kinds to declare, with the enforcement to claim (e.g. {regex: validated}). "
            "The text is answered as is: the service's validation of every structured result is "
            "what then holds, which is how tests check that it does."
        ),
    )


class ScriptedBug(RuntimeError):
    """The exception of `fail_with: unexpected`: no GengateError, as a backend's bug would raise."""


def split_tokens(text: str) -> list[str]:
    """Whitespace-word "tokens": each token carries its leading whitespace."""
    return _TOKEN.findall(text)


class ScriptedBackend:
    """Serves scripted text; stops at max_tokens and at stop strings like a real engine."""

    kind: ClassVar[str] = "scripted"
    Options: ClassVar[type[BaseModel]] = ScriptedOptions

    def __init__(self, name: str, options: ScriptedOptions) -> None:
        self.name = name
        self.options = options
        syntaxes = frozenset(GrammarSyntax) if ConstraintKind.GRAMMAR in options.constraints else frozenset()
        self.capabilities = ModelCapabilities(
            max_n=options.max_n, chat=True, constraints=dict(options.constraints), grammar_syntaxes=syntaxes
        )
        # Generations abandoned before their end (caller cancelled, deadline passed): what an
        # engine's abort would free, counted so tests can see the server did abort.
        self.cancelled = 0
        # Calls received, refused ones too (rate_limit_every; read through answer_calls_of).
        self.calls = 0
        _LIVE[name] = self

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await collect_stream(self.generate_stream(request))

    def _answer(self, request: GenerationRequest) -> str:
        watched_name = self.options.answer_cancellations_of or self.options.answer_calls_of
        if watched_name is not None:
            watched = _LIVE.get(watched_name)
            if watched is None:
                raise Unavailable(
                    f"no scripted model {watched_name!r} in this process",
                    reason="SCRIPTED_PROBE_TARGET_MISSING",
                )
            return str(watched.cancelled if self.options.answer_cancellations_of else watched.calls)
        if self.options.text is not None:
            return self.options.text
        if request.prompt is not None:
            return request.prompt
        return request.messages[-1].text if request.messages else ""

    def _prompt_tokens(self, request: GenerationRequest) -> int:
        if request.prompt is not None:
            return len(split_tokens(request.prompt))
        return sum(len(split_tokens(m.text)) for m in request.messages or ())

    def _enforcement(self, request: GenerationRequest) -> Enforcement:
        if request.structured_output is None:
            return Enforcement.NONE
        return self.options.constraints.get(request.structured_output.constraint.kind, Enforcement.NONE)

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        try:
            async for event in self._events(request):
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise

    async def _events(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        arrived = time.monotonic()
        self.calls += 1
        every = self.options.rate_limit_every
        if every is not None and (self.calls - 1) % every == 0:
            raise ResourceExhausted(
                f"scripted rate limit: call {self.calls} is the first of every {every}",
                reason="SCRIPTED_RATE_LIMIT",
                retry_after_s=self.options.rate_limit_retry_after_s,
            )
        input_tokens = self._prompt_tokens(request)
        yield StreamStart(
            request_id=request.request_id or uuid.uuid4().hex,
            model=self.name,
            input_tokens=input_tokens,
            enforcement=self._enforcement(request),
            effective_sampling=request.sampling,
            effective_stopping=request.stopping,
        )
        if self.options.latency_s:
            await asyncio.sleep(self.options.latency_s)
        tokens = split_tokens(self._answer(request))
        delay = 1.0 / self.options.tokens_per_s if self.options.tokens_per_s else 0.0
        for index in range(request.n):
            first_token_at: float | None = None
            text = ""
            emitted = 0
            finish, matched = FinishReason.STOP, None
            for token in tokens:
                if self.options.fail_after_tokens is not None and emitted >= self.options.fail_after_tokens:
                    if self.options.fail_with == "unexpected":
                        raise ScriptedBug("scripted unexpected failure (a stand-in for a backend bug)")
                    raise Unavailable("scripted failure mid-generation", reason="SCRIPTED_FAULT")
                if request.stopping.max_tokens is not None and emitted >= request.stopping.max_tokens:
                    finish = FinishReason.LENGTH
                    break
                candidate = text + token
                hit = next((s for s in request.stopping.stop if s in candidate), None)
                if hit is not None:
                    tail = candidate[: candidate.index(hit)][len(text) :]
                    if tail:
                        yield GenerationDelta(index=index, text=tail, token_count=1)
                    emitted += 1
                    finish, matched = FinishReason.STOP_SEQUENCE, hit
                    break
                if delay:
                    await asyncio.sleep(delay)
                first_token_at = first_token_at or time.monotonic()
                yield GenerationDelta(index=index, text=token, token_count=1)
                text = candidate
                emitted += 1
            now = time.monotonic()
            yield GenerationEnd(
                index=index,
                finish_reason=finish,
                matched_stop=matched,
                usage=Usage(input_tokens, emitted),
                timings=Timings(
                    queue_s=0.0,
                    time_to_first_token_s=(first_token_at or now) - arrived,
                    total_s=now - arrived,
                ),
            )
