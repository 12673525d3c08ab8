"""Hugging Face Text Generation Inference (TGI) and Inference Endpoints through the official
`huggingface_hub` AsyncInferenceClient.

A prompt goes to TGI's own /generate route (text_generation) and chat messages to its
/v1/chat/completions route; both take TGI's `grammar` ({"type": "json" | "regex", "value"}),
so JSON Schema, JSON object, choices (as a regex) and regex are all NATIVE. Lark/GBNF grammars
are refused. TGI has no `n`: the base fans out.

Tools are native on the chat route (TGI compiles the offered tools into its grammar, so a call's
arguments follow their schema): `tools`, `tool_choice` (auto / none / required, a named tool as
`{"type": "function", "function": {"name"}}`), assistant turns with `tool_calls` and `tool`
results, all in the chat-completions form (providers.openai_wire). TGI has no
`parallel_tool_calls` and makes one call per answer; the base's validation holds the switch.
Calls come back with arguments as text, or as a JSON object from older TGI (serialized). TGI's
tool stream ends without a finish reason: a stream that made calls ends with TOOL_CALLS. What TGI
cannot take is refused before any request: tools on a prompt (the raw /generate route has none),
tools beside a structured output (TGI: "Grammar and tools are mutually exclusive"), and an
assistant turn with both text and calls (TGI would read the text and drop the calls). The
endpoint's `reasoning` (or `reasoning_content`) comes back as the generation's reasoning; there
is no reasoning control.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from huggingface_hub import AsyncInferenceClient
from huggingface_hub.errors import HfHubHTTPError, TextGenerationError

from gengate import errors
from gengate.constraints.regex_dialect import ascii_shorthands
from gengate.domain import (
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    FinishReason,
    Generation,
    GenerationRequest,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    Role,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from gengate.providers import openai_wire as wire
from gengate.providers import structured as so
from gengate.providers.base import (
    Chunk,
    ChunkEnd,
    ChunkText,
    Completion,
    ProviderBackend,
    ProviderCall,
    ProviderOptions,
    map_finish_reason,
)
from gengate.providers.errors import from_status
from gengate.tools import TOOLS_UNSUPPORTED, first_tool_field

_TGI_ERROR_STATUS = {"OverloadedError": 429, "ValidationError": 422, "IncompleteGenerationError": 500}


class TGIOptions(ProviderOptions):
    """Config keys of a `tgi` model; `base_url` is the endpoint URL, `model` a label for it."""

    model: str = "tgi"
    base_url: str | None = None


def tgi_grammar(plan: so.StructuredPlan) -> dict[str, Any]:
    """The request's constraint as TGI's grammar parameter."""
    c = plan.structured.constraint
    if isinstance(c, JsonSchemaConstraint):
        return {"type": "json", "value": c.schema}
    if isinstance(c, JsonObjectConstraint):
        return {"type": "json", "value": {"type": "object"}}
    if isinstance(c, ChoiceConstraint):
        return {"type": "regex", "value": "|".join(f"(?:{re.escape(choice)})" for choice in c.choices)}
    if isinstance(c, RegexConstraint):
        return {"type": "regex", "value": ascii_shorthands(c.pattern)}
    raise errors.Unimplemented(
        f"TGI cannot enforce a {c.kind.value} constraint", reason="CONSTRAINT_UNSUPPORTED"
    )


def _get(obj: Any, name: str) -> Any:
    """A field of an SDK object or of the plain dict the SDK sometimes leaves nested."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _token_logprob(token: Any, top: Any = None) -> TokenLogprob:
    tops = tuple(
        TopLogprob(_get(t, "text"), _get(t, "logprob"), _get(t, "id"))
        for t in top or ()
        if _get(t, "logprob") is not None
    )
    return TokenLogprob(_get(token, "text"), _get(token, "logprob") or 0.0, _get(token, "id"), tops)


class TGIBackend(ProviderBackend):
    """A TGI server or Hugging Face Inference Endpoint."""

    kind: ClassVar[str] = "tgi"
    Options: ClassVar[type[ProviderOptions]] = TGIOptions
    label: ClassVar[str] = "TGI"
    structured_support: ClassVar[dict[ConstraintKind, Enforcement]] = {
        ConstraintKind.JSON_SCHEMA: Enforcement.NATIVE,
        ConstraintKind.JSON_OBJECT: Enforcement.NATIVE,
        ConstraintKind.CHOICE: Enforcement.NATIVE,
        ConstraintKind.REGEX: Enforcement.NATIVE,
    }
    native_n: ClassVar[bool] = False
    logprobs_supported: ClassVar[bool] = True
    max_top_logprobs: ClassVar[int] = 5
    raw_prompts: ClassVar[bool] = True  # a prompt goes to /generate as it is
    seed_supported: ClassVar[bool] = True
    requires_api_key: ClassVar[bool] = False  # a local TGI needs none; Inference Endpoints do
    tools_support: ClassVar[Enforcement | None] = Enforcement.NATIVE
    reasoning_output: ClassVar[bool] = True

    def __init__(self, name: str, options: ProviderOptions) -> None:
        super().__init__(name, options)
        self._client: AsyncInferenceClient | None = None

    async def start(self) -> None:
        await super().start()
        if not self.options.base_url:
            raise errors.ConfigError(f"model {self.name!r}: a tgi model needs base_url (the endpoint URL)")
        self._client = self._new_client(self.options.timeout)

    def _new_client(self, timeout: float) -> AsyncInferenceClient:
        # With no key configured the SDK would fall back to a Hugging Face token stored on this
        # machine (`hf auth login`) and send it to whatever endpoint the config names: an explicit
        # empty Authorization header overrides that fallback.
        headers = None if self.api_key else {"authorization": ""}
        return AsyncInferenceClient(
            model=self.options.base_url, token=self.api_key, timeout=timeout, headers=headers
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()  # type: ignore[no-untyped-call]
            self._client = None

    @property
    def client(self) -> AsyncInferenceClient:
        if self._client is None:
            raise RuntimeError(f"model {self.name!r} used before start()")
        return self._client

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        return so.StructuredPlan(req.structured_output, level, native=True)

    def _prepare(self, req: GenerationRequest) -> ProviderCall:
        """The base's checks, then the tool requests TGI cannot take (see the module docstring)."""
        call = super()._prepare(req)
        where = first_tool_field(req)
        if where is None:
            return call
        if req.messages is None:
            raise _refused(
                where, "TGI's raw prompt route (/generate) takes no tools: send the prompt as messages"
            )
        if req.tools and call.plan is not None:
            raise _refused(
                "structured_output", "TGI cannot take tools and a structured output in one request"
            )
        for i, m in enumerate(req.messages):
            if m.role is Role.ASSISTANT and m.tool_calls and m.text:
                raise errors.InvalidArgument.field(
                    f"messages.messages[{i}].content",
                    "is set beside tool_calls: TGI takes an assistant turn's calls or its text, not both",
                )
        return call

    def normalize_error(self, exc: BaseException) -> errors.GengateError:
        # text_generation re-raises TGI's typed errors without the HTTP status: use the cause.
        if isinstance(exc, TextGenerationError):
            cause = exc.__cause__
            response = getattr(cause, "response", None) if isinstance(cause, HfHubHTTPError) else None
            status = getattr(response, "status_code", None) or _TGI_ERROR_STATUS.get(type(exc).__name__, 500)
            headers = {str(k): str(v) for k, v in dict(getattr(response, "headers", {}) or {}).items()}
            return from_status(
                status, str(exc), headers=headers, provider=self.label, error_type=type(exc).__name__
            )
        return super().normalize_error(exc)

    def _generate_params(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        s = req.sampling
        params: dict[str, Any] = {
            "details": True,
            "max_new_tokens": req.stopping.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": s.seed,
            "repetition_penalty": s.repetition_penalty,
            "frequency_penalty": s.frequency_penalty,
            "stop": list(req.stopping.stop) or None,
            "top_n_tokens": req.logprobs or None,
        }
        if s.temperature is not None and s.temperature > 0:
            params["do_sample"] = True
        if call.plan is not None:
            params["grammar"] = tgi_grammar(call.plan)
        return {k: v for k, v in params.items() if v is not None}

    def _chat_params(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        s = req.sampling
        params: dict[str, Any] = {
            "messages": wire.messages(call),
            "max_tokens": req.stopping.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
            "frequency_penalty": s.frequency_penalty,
            "presence_penalty": s.presence_penalty,
            "stop": list(req.stopping.stop) or None,
            "logprobs": True if req.logprobs is not None else None,
            "top_logprobs": req.logprobs or None,
        }
        if call.plan is not None:
            params["response_format"] = tgi_grammar(call.plan)
        if req.tools:
            params["tools"] = [wire.tool(t) for t in req.tools]
        if req.tool_choice is not None:
            params["tool_choice"] = wire.tool_choice(req.tool_choice)
        return {k: v for k, v in params.items() if v is not None}

    async def _complete(self, call: ProviderCall) -> Completion:
        if call.request.messages is None:
            out = await self.client.text_generation(call.request.prompt or "", **self._generate_params(call))
            details = out.details
            logprobs = None
            if call.request.logprobs is not None and details is not None:
                tops = details.top_tokens or [None] * len(details.tokens)
                logprobs = tuple(_token_logprob(t, top) for t, top in zip(details.tokens, tops, strict=False))
            generation = Generation(
                index=0,
                text=out.generated_text,
                finish_reason=map_finish_reason(details.finish_reason if details else None),
                output_tokens=details.generated_tokens if details else 0,
                logprobs=logprobs,
            )
            return Completion([generation])
        response = await self.client.chat_completion(**self._chat_params(call))
        generations = [wire.chat_generation(c) for c in response.choices]
        usage = response.usage
        totals = Usage(usage.prompt_tokens, usage.completion_tokens) if usage else None
        return Completion(generations, totals)

    async def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        # The SDK keeps a streamed response open until its client closes: one client per stream,
        # closed in `finally`, so a cancelled consumer drops the upstream connection at once.
        client = self._new_client(call.timeout)
        try:
            if call.request.messages is None:
                stream = await client.text_generation(
                    call.request.prompt or "", stream=True, **self._generate_params(call)
                )
                async for event in stream:
                    if not event.token.special:
                        logprobs = (
                            (_token_logprob(event.token),) if call.request.logprobs is not None else None
                        )
                        yield ChunkText(0, event.token.text, logprobs)
                    if event.details is not None:
                        yield ChunkEnd(0, map_finish_reason(event.details.finish_reason))
            else:
                chat = await client.chat_completion(**self._chat_params(call), stream=True)
                called: set[int] = set()
                ended: set[int] = set()
                async for chunk in chat:
                    for choice in chunk.choices:
                        calls = wire.tool_call_deltas(choice.delta)
                        thought = wire.reasoning_text(choice.delta)
                        if calls:
                            called.add(choice.index)
                        if choice.delta.content or calls or thought:
                            yield ChunkText(
                                choice.index, choice.delta.content or "", tool_calls=calls, reasoning=thought
                            )
                        if choice.finish_reason:
                            ended.add(choice.index)
                            yield ChunkEnd(choice.index, map_finish_reason(choice.finish_reason))
                for index in sorted(called - ended):  # TGI ends a tool stream without a finish reason
                    yield ChunkEnd(index, FinishReason.TOOL_CALLS)
        finally:
            await client.close()  # type: ignore[no-untyped-call]


def _refused(field_name: str, why: str) -> errors.Unimplemented:
    """UNIMPLEMENTED TOOLS_UNSUPPORTED for a tool request TGI cannot take, naming the field."""
    return errors.Unimplemented(
        why, reason=TOOLS_UNSUPPORTED, violations=[errors.FieldViolation(field_name, why)]
    )
