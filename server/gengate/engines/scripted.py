"""A model-free backend: answers configured text (or echoes the prompt) at a set latency and
token rate, or configured tool calls. For users' own tests and for measuring the service's
overhead; it enforces no constraint and checks no call, and its capabilities say so: what holds
is the service's own validation, which is how tests show that it does."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

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
    Role,
    StreamEvent,
    StreamStart,
    Timings,
    ToolCall,
    ToolCallDelta,
    ToolChoiceMode,
    Usage,
    evolve,
)
from gengate.errors import ResourceExhausted, Unavailable

_TOKEN = re.compile(r"\s*\S+|\s+")

# Scripted models of this process by name, so a probe model can read another's counters.
_LIVE: weakref.WeakValueDictionary[str, ScriptedBackend] = weakref.WeakValueDictionary()


class ScriptedToolCall(BaseModel):
    """One tool call a scripted model answers."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str | dict[str, Any] = Field(
        default_factory=dict,
        description="The arguments: JSON text, sent exactly as written, or an object (sent as JSON).",
    )
    id: str = Field(default="", description="The call's id; empty: the server makes one.")

    def call(self) -> ToolCall:
        arguments = self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments)
        return ToolCall(id=self.id, name=self.name, arguments=arguments)


class ScriptedOptions(BaseModel):
    """Config keys of a `scripted` model."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(default=None, description="Answer text; the prompt is echoed when unset.")
    latency_s: float = Field(default=0.0, ge=0, description="Delay before the first token.")
    tokens_per_s: float | None = Field(default=None, gt=0, description="Token rate; unset = instant.")
    max_n: int = Field(default=16, ge=1)
    raw_prompt: bool = Field(
        default=False,
        description="Declare raw prompts (so Magpie requests reach it): each turn's prompt is echoed "
        "unless `text` is set.",
    )
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
    tool_calls: list[ScriptedToolCall] = Field(
        default_factory=list,
        description=(
            "Tool calls to answer (instead of text) when the request offers tools, tool_choice is not "
            "none and the conversation does not end with a tool result; streamed as fragments, then "
            "whole in the end frame. Not checked here: a call to a tool not offered or with wrong "
            "arguments is the service's to refuse."
        ),
    )
    tool_calls_when: Literal["asked", "always"] = Field(
        default="asked",
        description="`always`: answer tool_calls to every request, even one without tools or under none.",
    )
    tools_enforcement: Enforcement | None = Field(
        default=Enforcement.VALIDATED,
        description="The tools enforcement to declare (ListModels) and claim; null: tools are refused.",
    )
    finish_reason: FinishReason | None = Field(
        default=None,
        description=(
            "The finish reason every generation ends with, whatever happened (a fault for testing "
            "the service's fix-ups); unset: as a real engine would say."
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
            max_n=options.max_n,
            chat=True,
            constraints=dict(options.constraints),
            grammar_syntaxes=syntaxes,
            tools=options.tools_enforcement,
            raw_prompt=options.raw_prompt,
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
        if request.messages and request.messages[-1].role is Role.TOOL:
            return _tool_results(request)
        return request.messages[-1].text if request.messages else ""

    def _calls(self, request: GenerationRequest) -> tuple[ToolCall, ...]:
        """The calls to answer this request with (none: answer text)."""
        if not self.options.tool_calls:
            return ()
        if self.options.tool_calls_when == "asked":
            mode = request.tool_choice.mode if request.tool_choice is not None else ToolChoiceMode.AUTO
            messages = request.messages or ()
            answered = bool(messages) and messages[-1].role is Role.TOOL
            if not request.tools or mode is ToolChoiceMode.NONE or answered:
                return ()
        return tuple(c.call() for c in self.options.tool_calls)

    def _prompt_tokens(self, request: GenerationRequest) -> int:
        if request.prompt is not None:
            return len(split_tokens(request.prompt))
        return sum(len(split_tokens(m.text)) for m in request.messages or ())

    def _enforcement(self, request: GenerationRequest) -> Enforcement:
        if request.tools:
            return self.options.tools_enforcement or Enforcement.NONE
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
        calls = self._calls(request)
        tokens = [] if calls else split_tokens(self._answer(request))
        delay = 1.0 / self.options.tokens_per_s if self.options.tokens_per_s else 0.0
        for index in range(request.n):
            if calls:
                async for event in self._call_events(request, index, calls, input_tokens, arrived, delay):
                    yield event
                continue
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
                finish_reason=self.options.finish_reason or finish,
                matched_stop=matched,
                usage=Usage(input_tokens, emitted),
                timings=Timings(
                    queue_s=0.0,
                    time_to_first_token_s=(first_token_at or now) - arrived,
                    total_s=now - arrived,
                ),
            )

    async def _call_events(
        self,
        request: GenerationRequest,
        index: int,
        calls: tuple[ToolCall, ...],
        input_tokens: int,
        arrived: float,
        delay: float,
    ) -> AsyncIterator[StreamEvent]:
        """Generation `index` as tool calls: each call in two fragments (id and name on the
        first), one token each, cut at max_tokens like text; then the end frame with the calls
        begun (a cut one with the arguments streamed so far)."""
        made: list[ToolCall] = []
        emitted = 0
        finish = FinishReason.TOOL_CALLS
        first_token_at: float | None = None
        for position, call in enumerate(calls):
            half = len(call.arguments) // 2
            pieces = (call.arguments[: max(half, 1)], call.arguments[max(half, 1) :])
            for piece_index, piece in enumerate(pieces):
                if request.stopping.max_tokens is not None and emitted >= request.stopping.max_tokens:
                    finish = FinishReason.LENGTH
                    break
                if delay:
                    await asyncio.sleep(delay)
                first_token_at = first_token_at or time.monotonic()
                head = piece_index == 0
                fragment = ToolCallDelta(
                    position, id=call.id if head else "", name=call.name if head else "", arguments=piece
                )
                yield GenerationDelta(index=index, text="", token_count=1, tool_calls=(fragment,))
                emitted += 1
                if head:
                    made.append(evolve(call, arguments=piece))
                else:
                    made[-1] = call
            if finish is FinishReason.LENGTH:
                break
        now = time.monotonic()
        yield GenerationEnd(
            index=index,
            finish_reason=self.options.finish_reason or finish,
            usage=Usage(input_tokens, emitted),
            timings=Timings(
                queue_s=0.0, time_to_first_token_s=(first_token_at or now) - arrived, total_s=now - arrived
            ),
            tool_calls=tuple(made),
        )


def _tool_results(request: GenerationRequest) -> str:
    """The conversation's last tool results, one line each (`<call id> <tool name>: <result>`):
    what a scripted model answers after them, showing that the calls and results arrived."""
    names = {c.id: c.name for m in request.messages or () for c in m.tool_calls}
    lines = []
    for message in reversed(request.messages or ()):
        if message.role is not Role.TOOL:
            break
        lines.append(f"{message.tool_call_id} {names.get(message.tool_call_id, '?')}: {message.text}")
    return "\n".join(reversed(lines))
