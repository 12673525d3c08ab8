"""The shared provider backend: options, secrets, retries, `n` fan-out, structured output
(native or prompt + validate + bounded re-ask), tool calls (validated, re-asked the same way),
usage accounting and stream framing.

A provider module subclasses ProviderBackend and writes only the wire translation:
`_complete(call) -> Completion` (one unary upstream call, no retries) and
`_stream(call) -> AsyncIterator[Chunk]` (one upstream stream). See providers/__init__.py.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import logging
import math
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from gengate import errors
from gengate.backend import aclose_stream
from gengate.constraints import validate_output
from gengate.constraints.retries import VALIDATION_RETRIES, Attempts
from gengate.domain import (
    ChatMessage,
    ConstraintKind,
    Enforcement,
    FinishReason,
    Generation,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    GrammarSyntax,
    ImagePart,
    Modality,
    ModelCapabilities,
    ReasoningControl,
    Role,
    StreamEvent,
    StreamStart,
    TextPart,
    Timings,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
    with_system_text,
)
from gengate.providers import structured as so
from gengate.providers import toolcalls as tc
from gengate.providers.errors import (
    UPSTREAM_BAD_RESPONSE,
    UPSTREAM_PROTOCOL,
    normalize_exception,
    scrub,
)
from gengate.providers.retry import RetryPolicy, call_with_retries, stream_with_retries
from gengate.redaction import register_secret
from gengate.registry import KINDS
from gengate.tools import ToolSet

log = logging.getLogger("gengate.providers")


class ProviderOptions(BaseModel):
    """Config keys every provider accepts; a provider subclasses this to add its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="The provider's model (or deployment) name.")
    base_url: str | None = None
    api_key_env: str | None = Field(default=None, description="Environment variable holding the key.")
    api_key: SecretStr | None = Field(default=None, description="The key itself (prefer api_key_env).")
    timeout: float = Field(default=60.0, gt=0, description="Seconds per upstream attempt.")
    max_retries: int = Field(default=2, ge=0, le=10)
    validation_retries: int = Field(
        default=VALIDATION_RETRIES, ge=0, le=10, description="Re-asks after invalid output."
    )
    validation: bool = Field(default=True, description="Allow prompt + validate for non-native kinds.")
    max_n: int = Field(default=16, ge=1)
    context_length: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _one_key_source(self) -> ProviderOptions:
        if self.api_key_env is not None and self.api_key is not None:
            raise ValueError("set either api_key_env or api_key, not both")
        return self

    def resolve_api_key(self, env: Mapping[str, str] | None = None) -> str | None:
        """The key from `api_key` or the `api_key_env` variable; registered for redaction."""
        env = os.environ if env is None else env
        key = self.api_key.get_secret_value() if self.api_key is not None else None
        if key is None and self.api_key_env:
            key = env.get(self.api_key_env)
        register_secret(key)
        return key


def not_an_event_stream(label: str, why: str) -> errors.Unavailable:
    """The error for an upstream that answered a streaming request with something else."""
    return errors.Unavailable(
        f"{label} did not answer with a server-sent-event stream ({why})", reason=UPSTREAM_PROTOCOL
    )


def check_event_stream(label: str, content_type: str | None) -> None:
    """Raises Unavailable UPSTREAM_PROTOCOL when a streamed response's Content-Type says it is not
    `text/event-stream`: checked before reading, so a huge non-SSE body is never buffered whole."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media and media != "text/event-stream":
        raise not_an_event_stream(label, f"Content-Type {media}")


# --- what a provider module returns ------------------------------------------------------------


@dataclass(frozen=True)
class ProviderCall:
    """One upstream call: the chat to send, how many choices, and the structured plan."""

    request: GenerationRequest
    messages: tuple[ChatMessage, ...]
    n: int
    plan: so.StructuredPlan | None
    timeout: float


@dataclass
class Completion:
    """A unary upstream answer; `usage` None when the provider sent none. Each generation carries
    its tool calls as the provider made them (ids may be empty) and its reasoning."""

    generations: list[Generation]
    usage: Usage | None = None


@dataclass(frozen=True)
class ChunkText:
    """A fragment of choice `index`: text, tool-call fragments and reasoning text, any of them."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    token_count: int = 1
    tool_calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""


@dataclass(frozen=True)
class ChunkEnd:
    index: int
    finish_reason: FinishReason
    matched_stop: str | None = None
    reasoning_signatures: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChunkUsage:
    """Totals for the whole upstream call (all choices)."""

    input_tokens: int
    output_tokens: int


Chunk: TypeAlias = ChunkText | ChunkEnd | ChunkUsage


_FINISH_MAP = {
    "stop": FinishReason.STOP,
    "end_turn": FinishReason.STOP,
    "eos": FinishReason.STOP,
    "eos_token": FinishReason.STOP,
    "complete": FinishReason.STOP,
    "tool_calls": FinishReason.TOOL_CALLS,
    "function_call": FinishReason.TOOL_CALLS,
    "tool_use": FinishReason.TOOL_CALLS,
    "stop_sequence": FinishReason.STOP_SEQUENCE,
    "length": FinishReason.LENGTH,
    "max_tokens": FinishReason.LENGTH,
    "model_length": FinishReason.LENGTH,
    "content_filter": FinishReason.CONTENT_FILTER,
    "safety": FinishReason.CONTENT_FILTER,
    "recitation": FinishReason.CONTENT_FILTER,
    "blocklist": FinishReason.CONTENT_FILTER,
    "prohibited_content": FinishReason.CONTENT_FILTER,
    "spii": FinishReason.CONTENT_FILTER,
    "refusal": FinishReason.REFUSAL,
    "error": FinishReason.ERROR,
}


def map_finish_reason(raw: str | None) -> FinishReason:
    """A provider's finish reason (any case) as the domain enum; unknown values mean STOP."""
    if raw is None:
        return FinishReason.STOP
    return _FINISH_MAP.get(raw.lower(), FinishReason.STOP)


def estimate_tokens(text: str) -> int:
    """Tokenizer-free estimate used only when a provider reports no usage at all: ~4 characters
    per token for English-like text (OpenAI's rule of thumb), at least 1 for non-empty text."""
    return math.ceil(len(text) / 4) if text else 0


def estimate_prompt_tokens(messages: tuple[ChatMessage, ...]) -> int:
    """Estimate of a chat's input tokens: text estimate plus ~4 tokens of framing per message."""
    return sum(estimate_tokens(m.text) + 4 for m in messages)


def image_url(part: ImagePart) -> str:
    """An image part as a URL: the URL itself, or a base64 `data:` URL of inline bytes."""
    if part.url:
        return part.url
    mime = part.mime_type or "image/png"
    return f"data:{mime};base64,{base64.b64encode(part.data or b'').decode()}"


@dataclass
class _StreamTally:
    """Per-index bookkeeping while framing one upstream stream."""

    chunks: dict[int, int] = field(default_factory=dict)
    texts: dict[int, int] = field(default_factory=dict)
    ends: dict[int, ChunkEnd] = field(default_factory=dict)
    usage: ChunkUsage | None = None
    calls: tc.CallAssembly = field(default_factory=tc.CallAssembly)


class ProviderBackend(abc.ABC):
    """Base class of every remote provider backend (see module docstring)."""

    kind: ClassVar[str]
    Options: ClassVar[type[ProviderOptions]] = ProviderOptions
    label: ClassVar[str] = "provider"  # human name used in errors and logs
    structured_support: ClassVar[Mapping[ConstraintKind, Enforcement]] = {}
    grammar_syntaxes: ClassVar[frozenset[GrammarSyntax]] = frozenset()
    native_n: ClassVar[bool] = True
    logprobs_supported: ClassVar[bool] = False
    max_top_logprobs: ClassVar[int] = 0
    image_input: ClassVar[bool] = False
    seed_supported: ClassVar[bool] = False
    # A prompt request goes upstream as raw text (a completions route, no chat template): Magpie
    # can be served with a preset's chat format.
    raw_prompts: ClassVar[bool] = False
    requires_api_key: ClassVar[bool] = True
    # How the provider's tool calls are enforced; None: tools are refused until mapped.
    tools_support: ClassVar[Enforcement | None] = None
    # Takes GenerationRequest.reasoning (check_reasoning refuses the knobs it lacks).
    reasoning_controls: ClassVar[bool] = False
    # Returns the model's reasoning text (Generation.reasoning, GenerationDelta.reasoning).
    reasoning_output: ClassVar[bool] = False

    def __init__(self, name: str, options: ProviderOptions) -> None:
        self.name = name
        self.options = options
        self.api_key = options.resolve_api_key()
        if self.api_key is None and options.api_key is None and options.api_key_env is None:
            # the kind's standard variables (registry.KindSpec.key_envs), as its own SDK would read
            found = next((v for v in map(os.environ.get, self.default_api_key_envs()) if v), None)
            register_secret(found)
            self.api_key = found
        self.retry_policy = RetryPolicy(max_retries=options.max_retries)
        self.capabilities = self.build_capabilities()

    # --- hooks for provider modules ------------------------------------------------------------

    @abc.abstractmethod
    async def _complete(self, call: ProviderCall) -> Completion:
        """One unary upstream call (no retries: the base retries)."""

    @abc.abstractmethod
    def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        """One upstream stream; closing the iterator must close the HTTP response."""

    def supported_constraints(self) -> dict[ConstraintKind, Enforcement]:
        """This instance's constraint table (override to narrow per model or after a canary)."""
        return dict(self.structured_support)

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        """How to serve the request's constraint; default: send it as-is when native."""
        assert req.structured_output is not None
        return so.plan_openai_style(req.structured_output, level, strict_transform=False)

    def normalize_error(self, exc: BaseException) -> errors.GengateError:
        return normalize_exception(exc, provider=self.label)

    def check_reasoning(self, control: ReasoningControl) -> None:
        """Raises Unimplemented REASONING_UNSUPPORTED for a knob the provider lacks (called only
        when `reasoning_controls` is set and the request sets some knob)."""
        return None

    def final_tool_call(self, request: GenerationRequest, call: ToolCall) -> ToolCall:
        """A returned call as the caller gets it, before validation (default: as it came)."""
        return call

    def build_capabilities(self) -> ModelCapabilities:
        table = self.supported_constraints()
        if not self.options.validation:
            table = {k: v for k, v in table.items() if v != Enforcement.VALIDATED}
        syntaxes = self.grammar_syntaxes if ConstraintKind.GRAMMAR in table else frozenset()
        return ModelCapabilities(
            constraints=table,
            grammar_syntaxes=syntaxes,
            max_n=self.options.max_n,
            logprobs=self.logprobs_supported,
            max_top_logprobs=self.max_top_logprobs,
            input_modalities=frozenset(
                {Modality.TEXT, Modality.IMAGE} if self.image_input else {Modality.TEXT}
            ),
            context_length=self.options.context_length,
            seed=self.seed_supported,
            chat=True,
            raw_prompt=self.raw_prompts,
            tools=self.tools_support,
            reasoning_control=self.reasoning_controls,
            reasoning=self.reasoning_output,
        )

    # --- Backend protocol ----------------------------------------------------------------------

    @classmethod
    def default_api_key_envs(cls) -> tuple[str, ...]:
        """The key variables read when the config names neither api_key nor api_key_env."""
        spec = KINDS.get(cls.kind)
        return spec.key_envs if spec is not None else ()

    async def start(self) -> None:
        if self.requires_api_key and not self.api_key:
            where = self.options.api_key_env or " or ".join((*self.default_api_key_envs(), "api_key"))
            raise errors.ConfigError(f"model {self.name!r}: no API key for {self.label} (set {where})")

    async def aclose(self) -> None:
        return None

    def _check_tools_and_reasoning(self, req: GenerationRequest) -> None:
        """Refuses what the provider cannot honour (the service checks capabilities first; this
        keeps a direct caller, such as a composite, from having it silently dropped)."""
        provider = f"{self.label} model {self.name!r}"
        if self.capabilities.tools is None and tc.uses_tools(req):
            raise tc.tools_refused(req, provider)
        control = req.reasoning
        if control is None or (control.enabled, control.effort, control.budget_tokens) == (None,) * 3:
            return
        if not self.capabilities.reasoning_control:
            raise tc.reasoning_refused(provider, "reasoning", f"{provider} takes no reasoning control")
        self.check_reasoning(control)

    def _prepare(self, req: GenerationRequest) -> ProviderCall:
        self._check_tools_and_reasoning(req)
        plan: so.StructuredPlan | None = None
        messages = req.as_messages()
        if req.structured_output is not None:
            level = so.check_supported(
                req.structured_output,
                self.capabilities.constraints,
                provider=f"{self.label} model {self.name!r}",
                grammar_syntaxes=self.capabilities.grammar_syntaxes,
            )
            plan = self.plan_structured(req, level)
            if plan.instructions:
                messages = with_system_text(messages, plan.instructions)
        left = req.time_left()
        timeout = self.options.timeout if left is None else max(0.001, min(self.options.timeout, left))
        return ProviderCall(req, messages, req.n, plan, timeout)

    async def _complete_retrying(self, call: ProviderCall) -> Completion:
        return await call_with_retries(
            lambda: self._complete(call),
            policy=self.retry_policy,
            deadline=call.request.deadline,
            provider=self.label,
            normalize=self.normalize_error,
        )

    async def _complete_n(self, call: ProviderCall) -> tuple[list[Generation], Usage]:
        """`call.n` generations: native n, topped up by concurrent single calls when fewer
        choices came back (or all fanned out when the provider has no native n)."""
        wanted = call.n
        gens: list[Generation] = []
        usage = Usage()
        if self.native_n or wanted == 1:
            first = await self._complete_retrying(call)
            gens = first.generations[:wanted]
            usage = self._usage_or_estimate(first, call)
        missing = wanted - len(gens)
        if missing > 0:
            single = replace(call, n=1)
            more = await asyncio.gather(*(self._complete_retrying(single) for _ in range(missing)))
            for completion in more:
                gens.extend(completion.generations[:1])
                usage = usage + self._usage_or_estimate(completion, single)
        if len(gens) < wanted:
            raise errors.Unavailable(f"{self.label} returned {len(gens)} of {wanted} choices")
        return [replace(g, index=i) for i, g in enumerate(gens)], usage

    def _usage_or_estimate(self, completion: Completion, call: ProviderCall) -> Usage:
        if completion.usage is not None:
            return completion.usage
        return Usage(
            estimate_prompt_tokens(call.messages),
            sum(
                g.output_tokens or estimate_tokens(g.text + "".join(c.arguments for c in g.tool_calls))
                for g in completion.generations
            ),
        )

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        started = time.monotonic()
        call = self._prepare(request)
        gens, usage = await self._complete_n(call)
        enforcement = Enforcement.NONE
        if call.plan is not None:
            gens, extra = await self._enforce(call, gens)
            usage = usage + extra
            enforcement = call.plan.enforcement
        else:
            gens, extra = await self._enforce_tools(call, gens)
            usage = usage + extra
            enforcement = self._tools_enforcement(request)
        return self._result(request, gens, usage, enforcement, Timings(total_s=time.monotonic() - started))

    def _tools_enforcement(self, request: GenerationRequest) -> Enforcement:
        """The enforcement reported for a request: its tools' level when it offers tools."""
        if request.tools and self.capabilities.tools is not None:
            return self.capabilities.tools
        return Enforcement.NONE

    def _result(
        self,
        request: GenerationRequest,
        gens: list[Generation],
        usage: Usage,
        enforcement: Enforcement,
        timings: Timings,
    ) -> GenerationResult:
        return GenerationResult(
            request_id=request.request_id,
            model=self.name,
            generations=tuple(gens),
            usage=usage,
            enforcement=enforcement,
            effective_sampling=request.sampling,
            effective_stopping=request.stopping,
            timings=timings,
        )

    def offline_result(self, call: ProviderCall, completion: Completion) -> GenerationResult:
        """A provider batch's answer to one item, as `generate` would have returned it: the same
        choices, usage and structured-output validation against the original constraint, but no
        re-ask (a batch answers once): an invalid output raises Aborted VALIDATION_FAILED."""
        gens = completion.generations[: call.n]
        if len(gens) < call.n:
            raise errors.Unavailable(f"{self.label} returned {len(gens)} of {call.n} choices")
        gens = [replace(g, index=i) for i, g in enumerate(gens)]
        usage = self._usage_or_estimate(completion, call)
        enforcement = Enforcement.NONE
        if call.plan is not None:
            attempts = Attempts(0, kind=call.plan.kind, source=self.label)  # a batch answers once
            gens = self._validated(call.plan, gens, attempts)
            attempts.to_retry()
            enforcement = call.plan.enforcement
        else:
            attempts = Attempts(0, source=self.label)
            gens = self._tools_validated(call, gens, attempts, {})
            attempts.to_retry()
            enforcement = self._tools_enforcement(call.request)
        return self._result(call.request, gens, usage, enforcement, Timings())

    # --- structured output: validate, re-ask ---------------------------------------------------

    def _final_text(self, plan: so.StructuredPlan, text: str) -> str:
        if plan.native:
            return plan.unwrap(text)
        return so.clean_output(plan.structured, text)

    async def _enforce(self, call: ProviderCall, gens: list[Generation]) -> tuple[list[Generation], Usage]:
        """Validates every generation against the original constraint; re-asks invalid ones with
        the error up to `validation_retries` times; raises Aborted if any stays invalid."""
        plan = call.plan
        assert plan is not None
        extra = Usage()
        attempts = Attempts(self.options.validation_retries, kind=plan.kind, source=self.label)
        out = self._validated(plan, gens, attempts)
        round_no = 0
        while indices := attempts.to_retry():
            round_no += 1
            log.info(
                "%s: %d invalid structured result(s), re-asking (round %d)", self.name, len(indices), round_no
            )
            calls = [self._reask_call(call, *attempts.failing[i]) for i in indices]
            answers = await asyncio.gather(*(self._complete_retrying(c) for c in calls))
            for i, c, answer in zip(indices, calls, answers, strict=True):
                extra = extra + self._usage_or_estimate(answer, c)
                if not answer.generations:
                    attempts.failed(i, *attempts.failing[i])  # no answer: the try is spent all the same
                    continue
                g = answer.generations[0]
                text = self._final_text(plan, g.text)
                error = validate_output(plan.structured, text)
                if error is None:
                    out[i] = replace(g, index=i, text=text)
                    attempts.passed(i)
                else:
                    attempts.failed(i, error, g.text)
        return out, extra

    def _validated(
        self, plan: so.StructuredPlan, gens: list[Generation], attempts: Attempts
    ) -> list[Generation]:
        """The generations with their final text where valid; the invalid ones are recorded in
        `attempts` (error, raw text). Refusals and filtered outputs are left as they are (their
        finish reason says so)."""
        out = list(gens)
        for i, g in enumerate(out):
            if g.finish_reason in (FinishReason.REFUSAL, FinishReason.CONTENT_FILTER):
                continue  # reported as the finish reason, not as structured output
            text = self._final_text(plan, g.text)
            error = validate_output(plan.structured, text)
            if error is None:
                out[i] = replace(g, text=text)
            else:
                attempts.failed(i, error, g.text)
        return out

    def _reask_call(self, call: ProviderCall, error: str, bad_text: str) -> ProviderCall:
        feedback = (
            ChatMessage(Role.ASSISTANT, (TextPart(bad_text),)),
            ChatMessage(Role.USER, (TextPart(so.reask_message(error)),)),
        )
        return replace(call, messages=(*call.messages, *feedback), n=1)

    # --- tool calls: settle, validate, re-ask --------------------------------------------------

    def _tools_validated(
        self, call: ProviderCall, gens: list[Generation], attempts: Attempts, bad: dict[int, Generation]
    ) -> list[Generation]:
        """The generations with their calls settled (ids, finish reason); those whose calls the
        request does not allow are recorded in `attempts` and kept in `bad` for the re-ask."""
        toolset = ToolSet(call.request)
        out = [tc.settled(call.request, g, self.final_tool_call) for g in gens]
        for i, g in enumerate(out):
            error = tc.problem(toolset, g.finish_reason, g.tool_calls)
            if error is not None:
                attempts.failed(i, error, g.text)
                bad[i] = g
        return out

    def _tool_reask_call(self, call: ProviderCall, bad: Generation, error: str) -> ProviderCall:
        feedback = tc.reask_feedback(bad, error)
        return replace(call, messages=(*call.messages, *feedback), n=1)

    async def _enforce_tools(
        self, call: ProviderCall, gens: list[Generation]
    ) -> tuple[list[Generation], Usage]:
        """Validates every generation's tool calls against the request's tools and choice;
        re-asks an invalid one with the error (its calls answered by tool messages) up to
        `validation_retries` times; raises Aborted VALIDATION_FAILED if any stays invalid."""
        attempts = Attempts(self.options.validation_retries, source=self.label)
        bad: dict[int, Generation] = {}
        out = self._tools_validated(call, gens, attempts, bad)
        toolset = ToolSet(call.request)
        extra = Usage()
        round_no = 0
        while indices := attempts.to_retry():
            round_no += 1
            log.info("%s: %d invalid tool call(s), re-asking (round %d)", self.name, len(indices), round_no)
            calls = [self._tool_reask_call(call, bad[i], attempts.failing[i][0]) for i in indices]
            answers = await asyncio.gather(*(self._complete_retrying(c) for c in calls))
            for i, c, answer in zip(indices, calls, answers, strict=True):
                extra = extra + self._usage_or_estimate(answer, c)
                if not answer.generations:
                    attempts.failed(i, *attempts.failing[i])  # no answer: the try is spent all the same
                    continue
                g = replace(tc.settled(call.request, answer.generations[0], self.final_tool_call), index=i)
                error = tc.problem(toolset, g.finish_reason, g.tool_calls)
                if error is None:
                    out[i] = g
                    attempts.passed(i)
                else:
                    attempts.failed(i, error, g.text)
                    bad[i] = g
        return out, extra

    # --- streaming -----------------------------------------------------------------------------

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """Streams deltas; structured requests are generated, validated, then sent as one delta
        per generation (a delta is never retracted, so unvalidated text is never streamed)."""
        started = time.monotonic()
        call = self._prepare(request)
        if call.plan is not None:
            result = await self.generate(request)
            yield StreamStart(
                request.request_id,
                self.name,
                result.usage.input_tokens,
                result.enforcement,
                request.sampling,
                request.stopping,
            )
            for g in result.generations:
                reasoning = g.reasoning.text if g.reasoning is not None else ""
                yield GenerationDelta(g.index, g.text, g.output_tokens, g.logprobs, reasoning=reasoning)
            for g in result.generations:
                usage = Usage(result.usage.input_tokens, g.output_tokens)
                signatures = g.reasoning.signatures if g.reasoning is not None else ()
                yield GenerationEnd(
                    g.index, g.finish_reason, usage, g.matched_stop, result.timings, g.tool_calls, signatures
                )
            return
        yield StreamStart(
            request.request_id,
            self.name,
            estimate_prompt_tokens(call.messages),
            self._tools_enforcement(request),
            request.sampling,
            request.stopping,
        )
        first_token: list[float] = []
        done = 0
        if self.native_n or call.n == 1:
            async for event in self._frame_stream(call, 0, started, first_token):
                yield event
                if isinstance(event, GenerationEnd):
                    done += 1
        while done < call.n:
            # Fewer choices came back (or no native n): one single-choice stream per missing index.
            single = replace(call, n=1)
            async for event in self._frame_stream(single, done, started, first_token):
                yield event
            done += 1

    def _open(self, call: ProviderCall) -> AsyncGenerator[Chunk, None]:
        return stream_with_retries(
            lambda: self._checked_stream(call),
            policy=self.retry_policy,
            deadline=call.request.deadline,
            provider=self.label,
            normalize=self.normalize_error,
        )

    async def _checked_stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        """`_stream(call)`, but an upstream stream that ends without any chunk, or without any
        finish marker, raises Unavailable UPSTREAM_PROTOCOL: an upstream answering 200 with a
        body that is no event stream (a proxy's page, a JSON document) must not read as an empty
        success; nor must a first event the SDK cannot read. Before the first chunk the retry
        policy may try again."""
        stream = self._stream(call)
        seen = finished = False
        try:
            async for chunk in stream:
                seen = True
                finished = finished or isinstance(chunk, ChunkEnd)
                yield chunk
        except Exception as exc:
            if seen:
                raise
            error = self.normalize_error(exc)
            if error.reason == UPSTREAM_BAD_RESPONSE:  # the SDK could not read the first event
                raise not_an_event_stream(self.label, scrub(str(exc)) or type(exc).__name__) from exc
            raise error from exc
        finally:
            await aclose_stream(stream)
        if not seen:
            raise not_an_event_stream(self.label, "the response held no event")
        if not finished:
            raise errors.Unavailable(
                f"{self.label}'s stream ended without a finish reason: the upstream did not answer "
                "with a complete server-sent-event stream",
                reason=UPSTREAM_PROTOCOL,
            )

    async def _frame_stream(
        self, call: ProviderCall, offset: int, started: float, first_token: list[float]
    ) -> AsyncIterator[StreamEvent]:
        """Domain events of one upstream stream, indices shifted by `offset`; every end frame
        carries usage (the provider's, else counted chunks and an estimated prompt) and the
        generation's complete tool calls, validated: a streamed call cannot be re-asked once its
        fragments are out, so an invalid one ends the stream with Aborted VALIDATION_FAILED."""
        tally = _StreamTally()
        upstream = self._open(call)
        try:
            async for chunk in upstream:
                if isinstance(chunk, ChunkText):
                    if chunk.index >= call.n:
                        continue
                    if not first_token:
                        first_token.append(time.monotonic() - started)
                    tally.chunks[chunk.index] = tally.chunks.get(chunk.index, 0) + chunk.token_count
                    tally.texts[chunk.index] = tally.texts.get(chunk.index, 0) + len(chunk.text)
                    calls = tuple(tally.calls.add(chunk.index, f) for f in chunk.tool_calls)
                    if chunk.text or chunk.logprobs or calls or chunk.reasoning:
                        yield GenerationDelta(
                            chunk.index + offset,
                            chunk.text,
                            chunk.token_count,
                            chunk.logprobs,
                            calls,
                            chunk.reasoning,
                        )
                elif isinstance(chunk, ChunkEnd):
                    if chunk.index < call.n:
                        tally.ends[chunk.index] = chunk
                else:
                    tally.usage = chunk
        finally:
            await upstream.aclose()
        indices = sorted(tally.ends) or [0]
        input_tokens, per_index = self._stream_usage(call, tally, indices)
        timings = Timings(
            time_to_first_token_s=first_token[0] if first_token else None,
            total_s=time.monotonic() - started,
        )
        toolset = ToolSet(call.request)
        attempts = Attempts(0, source=self.label)  # nothing streamed is retracted: no re-ask
        settled: dict[int, tuple[FinishReason, tuple[ToolCall, ...]]] = {}
        for i in indices:
            end = tally.ends.get(i, ChunkEnd(i, FinishReason.STOP))
            settled[i] = tc.settle(call.request, end.finish_reason, tally.calls.of(i), self.final_tool_call)
            error = tc.problem(toolset, *settled[i])
            if error is not None:
                attempts.failed(i + offset, error)
        attempts.to_retry()
        for i in indices:
            end = tally.ends.get(i, ChunkEnd(i, FinishReason.STOP))
            finish, made = settled[i]
            yield GenerationEnd(
                i + offset,
                finish,
                Usage(input_tokens, per_index[i]),
                end.matched_stop,
                timings,
                made,
                end.reasoning_signatures,
            )

    def _stream_usage(
        self, call: ProviderCall, tally: _StreamTally, indices: list[int]
    ) -> tuple[int, dict[int, int]]:
        counted = {i: tally.chunks.get(i, 0) for i in indices}
        if tally.usage is None:
            return estimate_prompt_tokens(call.messages), counted
        total = tally.usage.output_tokens
        if len(indices) == 1:
            return tally.usage.input_tokens, {indices[0]: total}
        # The provider gives one total for all choices: split it by counted chunks.
        counted_sum = sum(counted.values()) or 1
        per = {i: (total * counted[i]) // counted_sum for i in indices}
        per[indices[-1]] += total - sum(per.values())
        return tally.usage.input_tokens, per
