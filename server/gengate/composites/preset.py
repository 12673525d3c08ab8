"""`preset`: another served model under its own name, with some backend options fixed.

    - name: llama-sql
      backend: preset
      model: llama                      # a served name
      backend_options: {lora: sql}      # set on every request

The way to serve a vLLM LoRA adapter as a model of its own (clients then only pick a name), or a
model with `min_tokens` / `ignore_eos` always on. The fixed keys must be options the model takes
(checked at start); a request cannot set them again (they are not among the preset's options),
everything else passes through unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from gengate.backend import aclose_stream
from gengate.composites.base import CompositeBackend, member_request
from gengate.domain import (
    BackendOptionValue,
    GenerationRequest,
    GenerationResult,
    ModelCapabilities,
    StreamEvent,
    StreamStart,
)
from gengate.errors import ConfigError


class PresetOptions(BaseModel):
    """Config keys of a `preset` model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="The served model this one calls.")
    backend_options: dict[str, BackendOptionValue] = Field(
        min_length=1, description="Backend options set on every request."
    )


class PresetBackend(CompositeBackend):
    """Calls its model with the preset's backend options added to each request."""

    kind: ClassVar[str] = "preset"
    Options: ClassVar[type[BaseModel]] = PresetOptions

    def __init__(self, name: str, options: PresetOptions) -> None:
        super().__init__(name)
        self.options = options

    def member_names(self) -> list[str]:
        return [self.options.model]

    def derive_capabilities(self) -> ModelCapabilities:
        caps = self.member(self.options.model).capabilities
        return dataclasses.replace(
            caps, backend_options=caps.backend_options - set(self.options.backend_options)
        )

    async def start(self) -> None:
        """Checks the fixed keys against what the (now loaded) model takes."""
        taken = self.member(self.options.model).capabilities.backend_options
        unknown = sorted(set(self.options.backend_options) - taken)
        if unknown:
            raise ConfigError(
                f"model {self.name!r} (preset): {unknown} not among the backend options of "
                f"{self.options.model!r} (it takes: {', '.join(sorted(taken)) or 'none'})"
            )
        await super().start()

    def _request(self, request: GenerationRequest) -> GenerationRequest:
        member = self.member(self.options.model)
        options = {**request.backend_options, **self.options.backend_options}
        return member_request(member, request, "p", backend_options=options)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self.member(self.options.model).generate(self._request(request))
        return dataclasses.replace(result, request_id=request.request_id, model=self.name)

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        stream = self.member(self.options.model).generate_stream(self._request(request))
        try:
            async for event in stream:
                if isinstance(event, StreamStart):
                    event = dataclasses.replace(event, request_id=request.request_id, model=self.name)
                yield event
        finally:
            await aclose_stream(stream)
