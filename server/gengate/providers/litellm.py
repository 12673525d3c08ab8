"""LiteLLM as a catch-all adapter: any model string LiteLLM knows ("anthropic/...",
"bedrock/...", "openai/<x>" with base_url for any OpenAI-compatible server, ...).

JSON Schema and choices are sent as OpenAI `response_format` json_schema (strict form) when
LiteLLM says the model supports response schemas (or the config says so), JSON object when it
supports `response_format`; everything else is prompted and validated; grammars are refused.
`n` is native when LiteLLM lists it for the model, else fanned out.

Tools are native where LiteLLM says the model calls functions (`supports_function_calling`, or
the config's `function_calling`); elsewhere they are refused (TOOLS_UNSUPPORTED). Requests and
answers are the OpenAI chat-completions form LiteLLM speaks (providers.openai_wire): `tools`,
`tool_choice` (a choice other than auto refused where LiteLLM lists no `tool_choice`),
`parallel_tool_calls` (sent where LiteLLM lists it; elsewhere the base's validation holds it),
tool turns, `message.tool_calls` and streamed `delta.tool_calls`. A tool asking for `strict` goes
in OpenAI's strict form where LiteLLM sends the model to OpenAI or Azure (or the config's
`strict_tools` says so) and the schema loses nothing by it; elsewhere validation alone holds it.
`reasoning.effort` goes as `reasoning_effort` and `reasoning.budget_tokens` as LiteLLM's
`thinking` (`{"type": "enabled", "budget_tokens"}`) where LiteLLM lists them (a knob it lacks,
and a bare switch, are refused). LiteLLM's `reasoning_content` comes back as the generation's
reasoning; its `thinking_blocks` (Anthropic's, via LiteLLM) as the reasoning's signatures, in
providers.anthropic_wire's form, and go back as `thinking_blocks` on the assistant turn they
came with (Anthropic requires them beside a tool call it answers when thinking is on).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar

# LiteLLM fetches its model price map from the internet at import unless told otherwise.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
from pydantic import Field

from gengate import errors
from gengate.domain import (
    ChatMessage,
    ConstraintKind,
    Enforcement,
    GenerationRequest,
    JsonSchemaConstraint,
    Reasoning,
    ReasoningControl,
    Role,
    Tool,
    ToolCall,
    ToolChoiceMode,
    Usage,
)
from gengate.providers import anthropic_wire
from gengate.providers import openai_wire as wire
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
    map_finish_reason,
)
from gengate.providers.errors import from_status
from gengate.redaction import register_secret
from gengate.tools import TOOLS_UNSUPPORTED


class LiteLLMOptions(ProviderOptions):
    """Config keys of a `litellm` model; `model` is LiteLLM's model string."""

    custom_llm_provider: str | None = Field(
        default=None, description="LiteLLM provider, if not in the model string."
    )
    response_schema: bool | None = Field(
        default=None, description="Whether the model enforces JSON Schema natively (default: ask LiteLLM)."
    )
    function_calling: bool | None = Field(
        default=None, description="Whether the model takes tools (default: ask LiteLLM)."
    )
    strict_tools: bool | None = Field(
        default=None,
        description="Whether a tool asking for strict goes in OpenAI's strict form (default: when "
        "LiteLLM sends the model to OpenAI or Azure themselves, no base_url).",
    )


def _model_facts(options: LiteLLMOptions) -> tuple[bool, set[str]]:
    """(supports response schema, supported OpenAI params) as LiteLLM reports them."""
    try:
        params = litellm.get_supported_openai_params(
            model=options.model, custom_llm_provider=options.custom_llm_provider
        )
    except Exception:  # unknown model/provider: assume the plain chat subset
        params = None
    schema = options.response_schema
    if schema is None:
        try:
            schema = bool(
                litellm.supports_response_schema(
                    model=options.model, custom_llm_provider=options.custom_llm_provider
                )
            )
        except Exception:
            schema = False
    return schema, set(params or ())


def _function_calling(options: LiteLLMOptions) -> bool:
    """Whether the model takes tools: the config's word, else LiteLLM's."""
    if options.function_calling is not None:
        return options.function_calling
    try:
        return bool(
            litellm.supports_function_calling(
                model=options.model, custom_llm_provider=options.custom_llm_provider
            )
        )
    except Exception:  # unknown model/provider: no tools
        return False


def _strict_tools(options: LiteLLMOptions) -> bool:
    """Whether tools asking for strict are sent strict: the config's word, else whether LiteLLM
    sends the model to OpenAI's or Azure's own API (which enforce strict function schemas)."""
    if options.strict_tools is not None:
        return options.strict_tools
    if options.base_url:
        return False  # some OpenAI-compatible server: strict may mean nothing there
    try:
        provider = litellm.get_llm_provider(options.model, custom_llm_provider=options.custom_llm_provider)[1]
    except Exception:
        return False
    return provider in ("openai", "azure")


def _get(obj: Any, name: str) -> Any:
    """A field of a LiteLLM object or of the plain dict it leaves nested (thinking blocks)."""
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _thought(block: Any, old: anthropic_wire.Thought | None = None) -> anthropic_wire.Thought | None:
    """A thinking block (or a streamed piece of one, added to `old`) as a Thought."""
    kind = _get(block, "type")
    if kind == "redacted_thinking":
        return anthropic_wire.Thought("", _get(block, "data") or "", redacted=True)
    if kind != "thinking":
        return old
    text, signature = (old.text, old.signature) if old is not None else ("", "")
    return anthropic_wire.Thought(
        text + (_get(block, "thinking") or ""), signature + (_get(block, "signature") or "")
    )


def _signed_reasoning(thoughts: list[anthropic_wire.Thought]) -> Reasoning | None:
    """Signed thinking blocks as a Reasoning with their signatures (None: none, or unsigned)."""
    if thoughts and all(t.signature for t in thoughts):
        return anthropic_wire.reasoning(thoughts)
    return None


def _messages(call: ProviderCall) -> list[dict[str, Any]]:
    """The chat as chat-completions messages, signed thinking back on its assistant turns."""
    out = wire.messages(call)
    for entry, m in zip(out, call.messages, strict=True):
        if _signed(m):
            assert m.reasoning is not None
            entry["thinking_blocks"] = anthropic_wire.thinking_blocks(m.reasoning)
    return out


def _signed(m: ChatMessage) -> bool:
    """Whether `m` is an assistant turn carrying signed thinking (which must go back with it)."""
    return m.role is Role.ASSISTANT and m.reasoning is not None and bool(m.reasoning.signatures)


_CREDENTIAL_SUFFIXES = ("_KEY", "_TOKEN", "_SECRET", "_PASSWORD")


class LiteLLMBackend(ProviderBackend):
    """Any model LiteLLM can reach, through litellm.acompletion."""

    kind: ClassVar[str] = "litellm"
    Options: ClassVar[type[ProviderOptions]] = LiteLLMOptions
    label: ClassVar[str] = "LiteLLM"
    requires_api_key: ClassVar[bool] = False  # LiteLLM reads each provider's own variables
    image_input: ClassVar[bool] = True
    reasoning_output: ClassVar[bool] = True  # LiteLLM's reasoning_content

    def __init__(self, name: str, options: ProviderOptions) -> None:
        assert isinstance(options, LiteLLMOptions)
        self._schema_native, self._params = _model_facts(options)
        self._tools = _function_calling(options)
        self._strict = _strict_tools(options)
        super().__init__(name, options)
        # LiteLLM reads each provider's key from its own variable: keep all of them out of messages.
        for variable, value in os.environ.items():
            if variable.upper().endswith(_CREDENTIAL_SUFFIXES):
                register_secret(value)

    @property
    def native_n(self) -> bool:  # type: ignore[override]
        return "n" in self._params

    @property
    def tools_support(self) -> Enforcement | None:  # type: ignore[override]
        """NATIVE where the model calls functions (LiteLLM's word or the config's), else None."""
        return Enforcement.NATIVE if self._tools else None

    @property
    def reasoning_controls(self) -> bool:  # type: ignore[override]
        """Whether LiteLLM lists a reasoning knob for the model (effort or a thinking budget)."""
        return bool({"reasoning_effort", "thinking"} & self._params)

    def check_reasoning(self, control: ReasoningControl) -> None:
        """Effort and a token budget where LiteLLM lists `reasoning_effort` / `thinking` for the
        model; a switch alone is refused (LiteLLM has no common one), as is a knob it lacks."""
        provider = f"{self.label} model {self.name!r}"
        if control.effort is not None and "reasoning_effort" not in self._params:
            raise tc.reasoning_refused(
                provider, "reasoning.effort", f"LiteLLM lists no reasoning_effort for {provider}"
            )
        if control.budget_tokens is not None and "thinking" not in self._params:
            raise tc.reasoning_refused(
                provider, "reasoning.budget_tokens", f"LiteLLM lists no thinking budget for {provider}"
            )
        if control.enabled is False or (control.enabled and control.budget_tokens is None):
            raise tc.reasoning_refused(
                provider,
                "reasoning.enabled",
                f"{provider} has no reasoning switch (use reasoning.effort or reasoning.budget_tokens)",
            )

    def supported_constraints(self) -> dict[ConstraintKind, Enforcement]:
        native = Enforcement.NATIVE if self._schema_native else Enforcement.VALIDATED
        json_object = Enforcement.NATIVE if "response_format" in self._params else Enforcement.VALIDATED
        return {
            ConstraintKind.JSON_SCHEMA: native,
            ConstraintKind.CHOICE: native,
            ConstraintKind.JSON_OBJECT: json_object,
            ConstraintKind.REGEX: Enforcement.VALIDATED,
        }

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        return so.plan_openai_style(req.structured_output, level, strict_transform=True)

    def normalize_error(self, exc: BaseException) -> errors.GengateError:
        status = getattr(exc, "status_code", None)
        headers = getattr(exc, "litellm_response_headers", None)
        if isinstance(status, int) and status >= 400 and isinstance(headers, Mapping):
            # LiteLLM keeps the upstream headers (Retry-After) here, not on its synthetic response.
            body = getattr(exc, "message", None) or str(exc)
            return from_status(
                status,
                body,
                headers={str(k): str(v) for k, v in headers.items()},
                provider=self.label,
                error_type=type(exc).__name__,
            )
        return super().normalize_error(exc)

    def _strict_parameters(self, tool: Tool) -> dict[str, Any] | None:
        """The tool's schema in OpenAI strict form where strict tools are sent (see the option)."""
        return wire.strict_parameters(tool) if self._strict else None

    def final_tool_call(self, request: GenerationRequest, call: ToolCall) -> ToolCall:
        """A strict tool's call without the nulls strict mode forced into its optional fields."""
        return wire.without_forced_nulls(request, call, self._strict_parameters)

    def _prepare(self, req: GenerationRequest) -> ProviderCall:
        """The base's checks, then a tool choice LiteLLM lists no `tool_choice` for: auto is the
        default anyway (not sent), any other is refused naming the field."""
        call = super()._prepare(req)
        choice = req.tool_choice
        auto = choice is not None and choice.name is None and choice.mode is ToolChoiceMode.AUTO
        if choice is not None and not auto and not self._takes("tool_choice"):
            raise errors.Unimplemented(
                f"LiteLLM lists no tool_choice for {self.label} model {self.name!r}",
                reason=TOOLS_UNSUPPORTED,
                violations=[errors.FieldViolation("tool_choice", "only auto: LiteLLM lists no tool_choice")],
            )
        return call

    def _takes(self, param: str) -> bool:
        """Whether LiteLLM lists `param` for the model (when it lists none, the model is unknown
        to it: the request's fields are passed on for the upstream to judge)."""
        return not self._params or param in self._params

    def _params_for(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        s = req.sampling
        params: dict[str, Any] = {
            "model": self.options.model,
            "messages": _messages(call),
            "timeout": call.timeout,
            "num_retries": 0,  # the base retries, with the caller's deadline in mind
            "max_retries": 0,
            "n": call.n if call.n > 1 else None,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "max_tokens": req.stopping.max_tokens,
            "stop": list(req.stopping.stop) or None,
            "api_base": self.options.base_url,
            "api_key": self.api_key,
            "custom_llm_provider": self.options.custom_llm_provider
            if isinstance(self.options, LiteLLMOptions)
            else None,
            "reasoning_effort": req.reasoning.effort.value
            if req.reasoning is not None and req.reasoning.effort is not None
            else None,
        }
        if req.reasoning is not None and req.reasoning.budget_tokens is not None:
            params["thinking"] = {"type": "enabled", "budget_tokens": req.reasoning.budget_tokens}
        if req.tools:
            params["tools"] = [wire.tool(t, self._strict_parameters(t)) for t in req.tools]
        if req.tool_choice is not None and self._takes("tool_choice"):
            params["tool_choice"] = wire.tool_choice(req.tool_choice)
        if req.parallel_tool_calls is not None and "parallel_tool_calls" in self._params:
            params["parallel_tool_calls"] = req.parallel_tool_calls
        plan = call.plan
        if plan is not None and plan.native:
            if plan.native_schema is None:
                params["response_format"] = {"type": "json_object"}
            else:
                c = plan.structured.constraint
                name = (c.name if isinstance(c, JsonSchemaConstraint) else "") or "output"
                params["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": plan.native_schema, "strict": plan.strict},
                }
        return {k: v for k, v in params.items() if v is not None}

    async def _complete(self, call: ProviderCall) -> Completion:
        response = await litellm.acompletion(**self._params_for(call))
        generations = []
        for choice in response.choices:
            blocks = _get(choice.message, "thinking_blocks") or ()
            thoughts = [t for t in (_thought(b) for b in blocks) if t is not None]
            generations.append(wire.chat_generation(choice, _signed_reasoning(thoughts)))
        usage = getattr(response, "usage", None)
        totals = Usage(usage.prompt_tokens or 0, usage.completion_tokens or 0) if usage else None
        return Completion(sorted(generations, key=lambda g: g.index), totals)

    async def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        params = self._params_for(call) | {"stream": True, "stream_options": {"include_usage": True}}
        stream = await litellm.acompletion(**params)
        thoughts: dict[int, dict[int, anthropic_wire.Thought]] = {}
        try:
            async for chunk in stream:
                for choice in chunk.choices:
                    text = (choice.delta.content if choice.delta else None) or ""
                    calls = wire.tool_call_deltas(choice.delta)
                    thought = wire.reasoning_text(choice.delta)
                    blocks = thoughts.setdefault(choice.index, {})
                    for block in _get(choice.delta, "thinking_blocks") or ():
                        at = _get(block, "index")
                        at = at if isinstance(at, int) else len(blocks)
                        got = _thought(block, blocks.get(at))
                        if got is not None:
                            blocks[at] = got
                    if text or calls or thought:
                        yield ChunkText(choice.index, text, tool_calls=calls, reasoning=thought)
                    if choice.finish_reason:
                        made = _signed_reasoning([b for _, b in sorted(blocks.items())])
                        signatures = made.signatures if made is not None else ()
                        yield ChunkEnd(
                            choice.index, map_finish_reason(choice.finish_reason), None, signatures
                        )
                usage = getattr(chunk, "usage", None)
                if usage is not None and usage.completion_tokens:
                    yield ChunkUsage(usage.prompt_tokens or 0, usage.completion_tokens)
        finally:
            await _close_stream(stream)


async def _close_stream(stream: Any) -> None:
    """Closes LiteLLM's stream wrapper and the upstream HTTP response under it."""
    inner = getattr(stream, "completion_stream", None)
    for target in (inner, getattr(inner, "response", None), stream):
        for name in ("aclose", "close"):
            method = getattr(target, name, None)
            if method is None:
                continue
            result = method()
            if hasattr(result, "__await__"):
                await result
            break
