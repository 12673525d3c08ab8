"""Mistral chat completions through the official `mistralai` SDK.

JSON Schema and choices are native through `response_format` {"type": "json_schema", strict}
(object root; others wrapped), JSON object natively; regex is prompted and validated; grammars
are refused. `n` is native.

Tools are native: `tools` (function tools, `strict` passed on), `tool_choice` (auto, none, any
for required, or the named function), `parallel_tool_calls`; calls come back in
`message.tool_calls` (finish reason `tool_calls`) and whole in stream deltas. Call ids sent are
mapped to Mistral's nine letters and digits (providers.mistral_wire). `reasoning.effort` is
`reasoning_effort`; thinking chunks come back as the generation's reasoning and go back in the
assistant turns that carry it. Mistral has no reasoning switch or token budget: those are
refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

import httpx
from mistralai.client import Mistral

from gengate.domain import (
    ConstraintKind,
    Enforcement,
    Generation,
    GenerationRequest,
    JsonSchemaConstraint,
    ReasoningControl,
    Usage,
)
from gengate.providers import mistral_wire as wire
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


class MistralOptions(ProviderOptions):
    """Config keys of a `mistral` model."""

    safe_prompt: bool | None = None


class MistralBackend(ProviderBackend):
    """Mistral models over /v1/chat/completions."""

    kind: ClassVar[str] = "mistral"
    Options: ClassVar[type[ProviderOptions]] = MistralOptions
    label: ClassVar[str] = "Mistral"
    structured_support: ClassVar[dict[ConstraintKind, Enforcement]] = {
        ConstraintKind.JSON_SCHEMA: Enforcement.NATIVE,
        ConstraintKind.CHOICE: Enforcement.NATIVE,
        ConstraintKind.JSON_OBJECT: Enforcement.NATIVE,
        ConstraintKind.REGEX: Enforcement.VALIDATED,
    }
    native_n: ClassVar[bool] = True
    image_input: ClassVar[bool] = True
    seed_supported: ClassVar[bool] = True
    tools_support: ClassVar[Enforcement | None] = Enforcement.NATIVE
    reasoning_controls: ClassVar[bool] = True  # reasoning_effort
    reasoning_output: ClassVar[bool] = True  # thinking chunks

    def __init__(self, name: str, options: ProviderOptions) -> None:
        super().__init__(name, options)
        self._client: Mistral | None = None
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        await super().start()
        self._http = httpx.AsyncClient(follow_redirects=True)
        self._client = Mistral(
            api_key=self.api_key,
            server_url=self.options.base_url,
            async_client=self._http,  # type: ignore[arg-type]  # an httpx.AsyncClient is what it wants
            timeout_ms=int(self.options.timeout * 1000),
        )

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._client = self._http = None

    @property
    def client(self) -> Mistral:
        if self._client is None:
            raise RuntimeError(f"model {self.name!r} used before start()")
        return self._client

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        return so.plan_object_root(req.structured_output, level)

    def check_reasoning(self, control: ReasoningControl) -> None:
        """Mistral has only reasoning_effort: its reasoning models always think (no switch), and
        it takes no thinking token budget."""
        provider = f"{self.label} model {self.name!r}"
        if control.budget_tokens is not None:
            raise tc.reasoning_refused(
                provider, "reasoning.budget_tokens", f"{self.label} takes no thinking token budget"
            )
        if control.enabled is not None:
            raise tc.reasoning_refused(
                provider, "reasoning.enabled", f"{self.label} has no reasoning switch (use reasoning.effort)"
            )

    def _tool_params(self, req: GenerationRequest) -> dict[str, Any]:
        """The request's tools, choice, parallel switch and reasoning effort as Mistral fields."""
        params: dict[str, Any] = {}
        if req.tools:
            params["tools"] = [wire.tool(t) for t in req.tools]
        if req.tool_choice is not None:
            params["tool_choice"] = wire.tool_choice(req.tool_choice)
        if req.parallel_tool_calls is not None:
            params["parallel_tool_calls"] = req.parallel_tool_calls
        if req.reasoning is not None and req.reasoning.effort is not None:
            params["reasoning_effort"] = req.reasoning.effort.value
        return params

    def _params(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        params: dict[str, Any] = {
            "model": self.options.model,
            "messages": wire.messages(call.messages),
            "retries": None,  # the base retries, with the caller's deadline in mind
            "timeout_ms": max(1, int(call.timeout * 1000)),
        }
        if call.n > 1:
            params["n"] = call.n
        s = req.sampling
        for key, value in (
            ("temperature", s.temperature),
            ("top_p", s.top_p),
            ("random_seed", s.seed),
            ("frequency_penalty", s.frequency_penalty),
            ("presence_penalty", s.presence_penalty),
            ("max_tokens", req.stopping.max_tokens),
        ):
            if value is not None:
                params[key] = value
        if req.stopping.stop:
            params["stop"] = list(req.stopping.stop)
        params.update(self._tool_params(req))
        if isinstance(self.options, MistralOptions) and self.options.safe_prompt is not None:
            params["safe_prompt"] = self.options.safe_prompt
        plan = call.plan
        if plan is not None and plan.native:
            if plan.native_schema is None:
                params["response_format"] = {"type": "json_object"}
            else:
                c = plan.structured.constraint
                name = (c.name if isinstance(c, JsonSchemaConstraint) else "") or "output"
                params["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": plan.native_schema, "strict": True},
                }
        return params

    async def _complete(self, call: ProviderCall) -> Completion:
        response = await self.client.chat.complete_async(**self._params(call))
        generations: list[Generation] = []
        for choice in response.choices or []:
            text, thoughts = wire.parts(choice.message)
            generations.append(
                Generation(
                    index=choice.index,
                    text=text,
                    finish_reason=map_finish_reason(choice.finish_reason),
                    tool_calls=wire.tool_calls(choice.message),
                    reasoning=wire.reasoning(thoughts),
                )
            )
        usage = response.usage
        totals = Usage(usage.prompt_tokens or 0, usage.completion_tokens or 0) if usage else None
        return Completion(sorted(generations, key=lambda g: g.index), totals)

    async def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        stream = await self.client.chat.stream_async(**self._params(call))
        state = wire.StreamState()
        try:
            async for event in stream:
                chunk = event.data
                for choice in chunk.choices:
                    i = choice.index
                    text, thoughts = wire.parts(choice.delta)
                    for thought in thoughts:
                        state.think(i, thought)
                    if text:
                        state.said(i)
                    calls = state.fragments(i, choice.delta)
                    thinking = "".join(t.text for t in thoughts)
                    if text or calls or thinking:
                        yield ChunkText(i, text, tool_calls=calls, reasoning=thinking)
                    if choice.finish_reason:
                        yield ChunkEnd(i, map_finish_reason(choice.finish_reason), None, state.signatures(i))
                if chunk.usage is not None:
                    yield ChunkUsage(chunk.usage.prompt_tokens or 0, chunk.usage.completion_tokens or 0)
        finally:
            await stream.close()  # type: ignore[no-untyped-call]
