"""Anthropic Messages API through the official `anthropic` SDK.

JSON Schema and choices are enforced natively with `output_config.format` (json_schema, the
schema adapted by the SDK's own `transform_schema`); regex and JSON-object are prompted and
validated; grammars are refused. Anthropic has no `n`: the base fans out. Offline jobs go
through Message Batches (one request per item and choice, each the online call's body).

Tools are native (tool_use / tool_result blocks, `tool_choice`, strict tools); thinking is set
by `thinking` (a token budget, adaptive, or disabled) and `output_config.effort`, and comes back
as the generation's reasoning with its signatures (the wire forms: providers.anthropic_wire).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import anthropic
from pydantic import Field

from gengate import errors
from gengate.backend import BatchOutcome, BatchState, BatchStatus
from gengate.domain import (
    ConstraintKind,
    Enforcement,
    FinishReason,
    Generation,
    GenerationRequest,
    ReasoningControl,
    StructuredOutput,
    Tool,
    ToolCall,
    ToolChoiceMode,
    Usage,
)
from gengate.providers import anthropic_wire as wire
from gengate.providers import batching, rawhttp
from gengate.providers import structured as so
from gengate.providers import toolcalls as tc
from gengate.providers.base import (
    Chunk,
    ChunkEnd,
    ChunkText,
    ChunkUsage,
    Completion,
    ProviderBackend,
    ProviderCall,
    ProviderOptions,
    check_event_stream,
    map_finish_reason,
)
from gengate.providers.errors import UnreadableAnswer, from_status
from gengate.providers.retry import call_with_retries
from gengate.providers.stainless import PreparedPosts, aiohttp_client
from gengate.tools import parameters_of

T = TypeVar("T")

# Anthropic's least thinking budget (`budget_tokens` below it is a 400).
MIN_THINKING_BUDGET = 1024

# Keywords Anthropic's structured outputs enforce; anything else is moved into a description by
# `transform_schema`, so the result is then only VALIDATED.
_ENFORCED_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "items",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$defs",
        "$ref",
        "description",
        "title",
        "additionalProperties",
        "format",
        "$schema",
    }
)


class AnthropicOptions(ProviderOptions):
    """Config keys of an `anthropic` model."""

    default_max_tokens: int = Field(
        default=1024, ge=1, description="max_tokens sent when the request sets none (the API requires one)."
    )
    max_n: int = Field(default=8, ge=1)


def _relaxed(node: Any) -> bool:
    """Whether `transform_schema` would demote part of this schema to a description."""
    if isinstance(node, list):
        return any(_relaxed(v) for v in node)
    if not isinstance(node, dict):
        return False
    for key, value in node.items():
        if key == "minItems" and value in (0, 1):
            continue
        if key not in _ENFORCED_KEYWORDS:
            return True
        if key == "additionalProperties" and value not in (False, None):
            return True  # free-form maps become closed objects on the wire
        if key in ("properties", "$defs") and isinstance(value, dict):
            if any(_relaxed(v) for v in value.values()):
                return True
        elif key in ("items", "anyOf", "oneOf", "allOf") and _relaxed(value):
            return True
    return False


def anthropic_plan(structured: StructuredOutput, level: Enforcement) -> so.StructuredPlan:
    """JSON Schema / choice as an `output_config` schema adapted by the SDK's `transform_schema`
    (object root; others wrapped); everything else prompted and validated."""
    return so.plan_object_root(structured, level, transform=anthropic.transform_schema, relaxed=_relaxed)


def _thinks(control: ReasoningControl | None) -> bool:
    """Whether the request turns thinking on (a budget, or enabled)."""
    return (
        control is not None
        and control.enabled is not False
        and (control.budget_tokens is not None or control.enabled is True)
    )


def _thinking(control: ReasoningControl) -> dict[str, Any] | None:
    """`thinking`: a budget as manual extended thinking, enabled alone as adaptive (Claude
    decides how much), enabled false as disabled; None: the model's default."""
    if control.budget_tokens is not None:
        return {"type": "enabled", "budget_tokens": control.budget_tokens}
    if control.enabled is True:
        return {"type": "adaptive"}
    if control.enabled is False:
        return {"type": "disabled"}
    return None


def _usage(answer: Any) -> Usage:
    """A Message's (or a stream event's) `usage`, zero where absent."""
    usage = rawhttp.member(answer, "usage") if answer is not None else None
    if usage is None:
        return Usage()
    return Usage(rawhttp.integer(usage, "input_tokens") or 0, rawhttp.integer(usage, "output_tokens") or 0)


def _block_index(event: Any) -> int:
    index = rawhttp.integer(event, "index")
    if index is None:
        raise UnreadableAnswer("a content block event has no `index`")
    return index


def _stream_error(event: Mapping[str, Any], data: bytes) -> str:
    """An error event's message (the SDK's reading: its error's message, else the event as sent)."""
    error = event.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) and message else data.decode("utf-8", "replace")


def _finish(stop_reason: str | None) -> FinishReason:
    if stop_reason == "model_context_window_exceeded":
        return FinishReason.LENGTH
    return map_finish_reason(stop_reason)


class AnthropicBackend(ProviderBackend):
    """Claude models over the Messages API."""

    kind: ClassVar[str] = "anthropic"
    Options: ClassVar[type[ProviderOptions]] = AnthropicOptions
    label: ClassVar[str] = "Anthropic"
    structured_support: ClassVar[dict[ConstraintKind, Enforcement]] = {
        ConstraintKind.JSON_SCHEMA: Enforcement.NATIVE,
        ConstraintKind.CHOICE: Enforcement.NATIVE,
        ConstraintKind.JSON_OBJECT: Enforcement.VALIDATED,
        ConstraintKind.REGEX: Enforcement.VALIDATED,
    }
    native_n: ClassVar[bool] = False
    image_input: ClassVar[bool] = True
    tools_support: ClassVar[Enforcement | None] = Enforcement.NATIVE
    reasoning_controls: ClassVar[bool] = True
    reasoning_output: ClassVar[bool] = True

    def __init__(self, name: str, options: ProviderOptions) -> None:
        super().__init__(name, options)
        self._client: anthropic.AsyncAnthropic | None = None
        self._posts: PreparedPosts | None = None

    @property
    def opts(self) -> AnthropicOptions:
        assert isinstance(self.options, AnthropicOptions)
        return self.options

    async def start(self) -> None:
        await super().start()
        self._client = anthropic.AsyncAnthropic(
            api_key=self.api_key,
            base_url=self.options.base_url,
            timeout=self.options.timeout,
            max_retries=0,
            http_client=aiohttp_client(anthropic, self.options.timeout),
        )
        self._posts = PreparedPosts(self._client, "anthropic")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = self._posts = None

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        return anthropic_plan(req.structured_output, level)

    @property
    def client(self) -> anthropic.AsyncAnthropic:
        if self._client is None:
            raise RuntimeError(f"model {self.name!r} used before start()")
        return self._client

    # --- tools and thinking ----------------------------------------------------------------

    def check_reasoning(self, control: ReasoningControl) -> None:
        """Every knob maps (a budget, adaptive, disabled, output_config.effort); a budget under
        Anthropic's floor is refused here rather than by a 400 upstream."""
        if control.budget_tokens is not None and control.budget_tokens < MIN_THINKING_BUDGET:
            raise errors.InvalidArgument.field(
                "reasoning.budget_tokens",
                f"is {control.budget_tokens}, under Anthropic's least of {MIN_THINKING_BUDGET}",
            )

    def _prepare(self, req: GenerationRequest) -> ProviderCall:
        """The base's checks, then what only Anthropic refuses: a budget that leaves max_tokens
        nothing, a forced tool call while thinking, call arguments that are no JSON object."""
        call = super()._prepare(req)
        violations = wire.history_violations(req.messages or ())
        if violations:
            raise errors.InvalidArgument(
                "; ".join(f"{v.field}: {v.description}" for v in violations), violations=violations
            )
        control = req.reasoning
        budget = control.budget_tokens if control is not None else None
        max_tokens = req.stopping.max_tokens
        if budget is not None and max_tokens is not None and max_tokens <= budget:
            raise errors.InvalidArgument.field(
                "reasoning.budget_tokens",
                f"is {budget}, not under stopping.max_tokens ({max_tokens}): Anthropic counts "
                "thinking in max_tokens",
            )
        choice = req.tool_choice
        forced = choice is not None and (choice.name is not None or choice.mode is ToolChoiceMode.REQUIRED)
        if forced and _thinks(control):
            raise tc.reasoning_refused(
                f"{self.label} model {self.name!r}",
                "tool_choice",
                f"{self.label} cannot force a tool call while thinking: use auto or none, "
                "or turn thinking off",
            )
        return call

    def _strict_schema(self, tool: Tool) -> dict[str, Any] | None:
        """A strict tool's schema as Anthropic's strict mode takes it, when it loses nothing."""
        if not tool.strict:
            return None
        schema = dict(parameters_of(tool))
        if _relaxed(schema):
            return None
        try:
            return dict(anthropic.transform_schema(schema))
        except (ValueError, TypeError, KeyError, AssertionError):
            return None

    def _tool_params(self, req: GenerationRequest) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if req.tools:
            params["tools"] = [wire.tool(t, self._strict_schema(t)) for t in req.tools]
        choice = wire.tool_choice(req.tool_choice, req.parallel_tool_calls)
        if choice is not None:
            params["tool_choice"] = choice
        return params

    def _max_tokens(self, req: GenerationRequest) -> int:
        """The request's max_tokens; unset, the default answer length, after the thinking
        budget when there is one (Anthropic counts thinking in max_tokens)."""
        if req.stopping.max_tokens:
            return req.stopping.max_tokens
        budget = req.reasoning.budget_tokens if req.reasoning is not None else None
        return self.opts.default_max_tokens + (budget or 0)

    def final_tool_call(self, request: GenerationRequest, call: ToolCall) -> ToolCall:
        """A streamed call to a tool without parameters may carry no input text: `{}`."""
        if call.arguments.strip():
            return call
        return dataclasses.replace(call, arguments="{}")

    # --- upstream calls ------------------------------------------------------------------------

    def _params(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        system, messages = wire.messages(call.messages)
        params: dict[str, Any] = {
            "model": self.options.model,
            "messages": messages,
            "max_tokens": self._max_tokens(req),
            "timeout": call.timeout,
        }
        if system:
            params["system"] = system
        if req.stopping.stop:
            params["stop_sequences"] = list(req.stopping.stop)
        s = req.sampling
        for key, value in (("temperature", s.temperature), ("top_p", s.top_p), ("top_k", s.top_k)):
            if value is not None:
                params[key] = value
        params.update(self._tool_params(req))
        output_config: dict[str, Any] = {}
        if call.plan is not None and call.plan.native and call.plan.native_schema is not None:
            output_config["format"] = {"type": "json_schema", "schema": call.plan.native_schema}
        control = req.reasoning
        if control is not None:
            thinking = _thinking(control)
            if thinking is not None:
                params["thinking"] = thinking
            if control.effort is not None:
                output_config["effort"] = control.effort.value
        if output_config:
            params["output_config"] = output_config
        return params

    async def _post(self, call: ProviderCall, *, stream: bool) -> Any:
        """One Messages request, a copy of the SDK's own (providers.stainless), answered unread
        (providers.rawhttp)."""
        params = self._params(call)
        if stream:
            params["stream"] = True
        body, options = rawhttp.sdk_request(params)
        if self._posts is None:
            raise RuntimeError(f"model {self.name!r} used before start()")
        return await self._posts.post("/v1/messages", body, options)

    async def _complete(self, call: ProviderCall) -> Completion:
        return self._completion(await rawhttp.read_object(await self._post(call, stream=False)))

    @staticmethod
    def _completion(message: Any) -> Completion:
        """A Message (its JSON, or the SDK's object from a batch) as one generation (text, calls,
        thinking) and its usage."""
        text, calls, reasoning = wire.message_parts(rawhttp.objects(message, "content"))
        usage = _usage(message)
        generation = Generation(
            index=0,
            text=text,
            finish_reason=_finish(rawhttp.optional_text(message, "stop_reason")),
            output_tokens=usage.output_tokens,
            matched_stop=rawhttp.optional_text(message, "stop_sequence"),
            tool_calls=calls,
            reasoning=reasoning,
        )
        return Completion([generation], usage)

    async def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        response = await self._post(call, stream=True)
        input_tokens = 0
        blocks = wire.StreamBlocks()
        try:
            check_event_stream(self.label, response.headers.get("content-type"))
            async for sse in rawhttp.events(response):
                event = rawhttp.loads_object(sse.data, "an event of its stream")
                kind = event.get("type") or sse.name
                if kind == "error" or sse.name == "error":
                    raise UnreadableAnswer(_stream_error(event, sse.data))
                if kind == "message_start":
                    input_tokens = _usage(rawhttp.member(event, "message")).input_tokens
                elif kind == "content_block_start":
                    fragment = blocks.start(_block_index(event), rawhttp.member(event, "content_block"))
                    if fragment is not None:
                        yield ChunkText(0, "", tool_calls=(fragment,))
                elif kind == "content_block_delta":
                    index = _block_index(event)
                    delta = rawhttp.member(event, "delta")
                    delta_kind = rawhttp.field(delta, "type")
                    if delta_kind == "text_delta":
                        yield ChunkText(0, rawhttp.text(delta, "text"))
                    elif delta_kind == "input_json_delta":
                        fragment = blocks.arguments(index, rawhttp.text(delta, "partial_json"))
                        if fragment is not None:
                            yield ChunkText(0, "", tool_calls=(fragment,))
                    elif delta_kind == "thinking_delta":
                        thought = rawhttp.text(delta, "thinking")
                        blocks.think(index, thought)
                        yield ChunkText(0, "", reasoning=thought)
                    elif delta_kind == "signature_delta":
                        blocks.sign(index, rawhttp.text(delta, "signature"))
                elif kind == "content_block_stop":
                    fragment = blocks.stop(_block_index(event))
                    if fragment is not None:
                        yield ChunkText(0, "", tool_calls=(fragment,))
                elif kind == "message_delta":
                    delta = rawhttp.member(event, "delta")
                    finish = _finish(rawhttp.optional_text(delta, "stop_reason") if delta else None)
                    stop = rawhttp.optional_text(delta, "stop_sequence") if delta else None
                    yield ChunkEnd(0, finish, stop, blocks.signatures())
                    yield ChunkUsage(input_tokens, _usage(event).output_tokens)
        finally:
            await response.aclose()

    # --- Message Batches (backend.OfflineBatches) ----------------------------------------------

    @property
    def max_batch_items(self) -> int:
        """Anthropic takes 100,000 requests a batch; an item takes one per choice (no `n`)."""
        return MAX_BATCH_REQUESTS // self.options.max_n

    async def _upstream(self, attempt: Callable[[], Awaitable[T]]) -> T:
        return await call_with_retries(
            attempt,
            policy=self.retry_policy,
            deadline=None,
            provider=self.label,
            normalize=self.normalize_error,
        )

    async def submit_batch(self, items: Sequence[tuple[int, GenerationRequest]]) -> str:
        """One Message Batch: each request's `params` is the online call's body (`_params`)."""
        batching.check_size(self, items, self.max_batch_items)
        requests: list[Any] = []
        for cid, call in batching.batch_requests(self, items):
            params = self._params(call)
            params.pop("timeout", None)  # the SDK's, not the API's
            requests.append({"custom_id": cid, "params": params})
        batch = await self._upstream(lambda: self.client.messages.batches.create(requests=requests))
        return batch.id

    async def batch_status(self, batch_id: str) -> BatchStatus:
        batch = await self._upstream(lambda: self.client.messages.batches.retrieve(batch_id))
        counts = batch.request_counts
        total = counts.processing + counts.succeeded + counts.errored + counts.canceled + counts.expired
        if batch.processing_status != "ended":
            state = BatchState.RUNNING
        elif counts.succeeded + counts.errored == 0 and counts.expired:
            state = BatchState.EXPIRED
        elif batch.cancel_initiated_at is not None:
            state = BatchState.CANCELLED
        else:
            state = BatchState.ENDED  # each canceled or expired request says so in its result
        error = "the Anthropic batch expired before any item ran" if state is BatchState.EXPIRED else ""
        return BatchStatus(state, total, counts.succeeded, counts.errored + counts.expired, error)

    async def batch_results(
        self, batch_id: str, items: Mapping[int, GenerationRequest]
    ) -> AsyncIterator[BatchOutcome]:
        collector = batching.BatchCollector(self, items)
        decoder = await self._upstream(lambda: self.client.messages.batches.results(batch_id))
        try:
            async for entry in decoder:
                outcome = collector.add(entry.custom_id, self._batch_answer(entry.result))
                if outcome is not None:
                    yield outcome
        except errors.GengateError:
            raise
        except Exception as exc:
            raise self.normalize_error(exc) from exc
        finally:
            await decoder.close()
        for outcome in collector.unfinished():
            yield outcome

    def _batch_answer(self, result: Any) -> batching.Answer:
        kind = getattr(result, "type", None)
        if kind == "succeeded":
            message = result.message
            return lambda call: self._completion(message)
        if kind == "canceled":
            return batching.cancelled(self.label)
        if kind == "expired":
            return batching.expired(self.label)
        inner = getattr(getattr(result, "error", None), "error", None)
        error_type = str(getattr(inner, "type", "") or "api_error")
        message = str(getattr(inner, "message", "") or "")
        status = _ERROR_STATUS.get(error_type, 500)
        return from_status(status, message, provider=self.label, error_type=error_type)

    async def cancel_batch(self, batch_id: str) -> None:
        await self._upstream(lambda: self.client.messages.batches.cancel(batch_id))


# Anthropic's limit on requests in one Message Batch (and 256 MB).
MAX_BATCH_REQUESTS = 100_000

# The HTTP status each Anthropic error type comes with, for an errored batch request.
_ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
