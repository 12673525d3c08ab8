"""Mistral chat completions through the official `mistralai` SDK.

JSON Schema and choices are native through `response_format` {"type": "json_schema", strict}
(object root; others wrapped), JSON object natively; regex is prompted and validated; grammars
are refused. `n` is native.
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
    ImagePart,
    JsonSchemaConstraint,
    TextPart,
    Usage,
)
from gengate.providers import structured as so
from gengate.providers.base import (
    Chunk,
    ChunkEnd,
    ChunkText,
    ChunkUsage,
    Completion,
    ProviderBackend,
    ProviderCall,
    ProviderOptions,
    image_url,
    map_finish_reason,
)


class MistralOptions(ProviderOptions):
    """Config keys of a `mistral` model."""

    safe_prompt: bool | None = None


def _content(parts: tuple[TextPart | ImagePart, ...]) -> str | list[dict[str, Any]]:
    if all(isinstance(p, TextPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    return [
        {"type": "text", "text": p.text}
        if isinstance(p, TextPart)
        else {"type": "image_url", "image_url": image_url(p)}
        for p in parts
    ]


def _text(content: Any) -> str:
    """Message content as text: a string, or the text chunks of a chunk list."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(getattr(chunk, "text", "") or "" for chunk in content)


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

    def _params(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        params: dict[str, Any] = {
            "model": self.options.model,
            "messages": [{"role": m.role.value, "content": _content(m.content)} for m in call.messages],
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
        generations = [
            Generation(
                index=choice.index,
                text=_text(choice.message.content if choice.message else None),
                finish_reason=map_finish_reason(choice.finish_reason),
            )
            for choice in response.choices or []
        ]
        usage = response.usage
        totals = Usage(usage.prompt_tokens or 0, usage.completion_tokens or 0) if usage else None
        return Completion(sorted(generations, key=lambda g: g.index), totals)

    async def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        stream = await self.client.chat.stream_async(**self._params(call))
        try:
            async for event in stream:
                chunk = event.data
                for choice in chunk.choices:
                    text = _text(choice.delta.content)
                    if text:
                        yield ChunkText(choice.index, text)
                    if choice.finish_reason:
                        yield ChunkEnd(choice.index, map_finish_reason(choice.finish_reason))
                if chunk.usage is not None:
                    yield ChunkUsage(chunk.usage.prompt_tokens or 0, chunk.usage.completion_tokens or 0)
        finally:
            await stream.close()  # type: ignore[no-untyped-call]
