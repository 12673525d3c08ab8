"""Outlines 1.x model adapter: use a gengate model with `outlines.Generator(model, output_type)`.

    import outlines
    from gengate_client import Client
    from gengate_client.outlines import from_gengate

    model = from_gengate(Client("localhost:50051"), "tiny")
    person_json = outlines.Generator(model, Person)("Make up a person", max_tokens=200)

Like Outlines' vLLM-server and SGLang adapters, the output type is sent to the server as a
constraint; the server enforces it. Results are text, as with every Outlines black-box model.
Needs the `outlines` extra: `pip install gengate-client[outlines]`.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from outlines.inputs import Chat
from outlines.models.base import ModelTypeAdapter
from outlines.models.vllm import VLLM, AsyncVLLM

from gengate_client.aio import AsyncClient
from gengate_client.client import Client
from gengate_client.output_types import OutputSpec, resolve_output_type
from gengate_client.types import StreamDelta

__all__ = ["AsyncGengate", "Gengate", "GengateTypeAdapter", "from_gengate"]

# Outlines / OpenAI-style keyword names accepted as aliases of gengate's own.
_ALIASES = {"max_new_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "stop_strings": "stop"}


class GengateTypeAdapter(ModelTypeAdapter):
    """Formats Outlines inputs as gengate prompt/messages and output types as constraints."""

    def format_input(self, model_input: Any) -> dict[str, Any]:
        """A str becomes `prompt`; a Chat or a list of message dicts becomes `messages`."""
        if isinstance(model_input, str):
            return {"prompt": model_input}
        if isinstance(model_input, Chat):
            return {"messages": [_message(m) for m in model_input.messages]}
        if isinstance(model_input, list) and model_input and all(isinstance(m, Mapping) for m in model_input):
            return {"messages": [_message(m) for m in model_input]}
        if isinstance(model_input, list) and model_input and isinstance(model_input[0], str):
            # [text, Image, ...]: one user turn with images.
            return {"messages": [_message({"role": "user", "content": model_input})]}
        raise TypeError(
            "gengate models take a str, an outlines.inputs.Chat or a list of messages, "
            f"not {type(model_input)}"
        )

    def format_output_type(self, output_type: Any = None) -> OutputSpec | None:
        """The constraint sent to the server (None for plain text)."""
        return resolve_output_type(output_type)


def _part(part: Any) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if hasattr(part, "image_str") and hasattr(part, "image_format"):  # outlines.inputs.Image
        return {"type": "image", "data": base64.b64decode(part.image_str), "mime_type": part.image_format}
    if isinstance(part, Mapping):
        return dict(part)
    raise TypeError(f"unsupported content part {type(part)}")


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message["content"]
    if not isinstance(content, str):
        content = [_part(p) for p in content]
    return {"role": message["role"], "content": content}


def _call_kwargs(
    adapter: ModelTypeAdapter, model_input: Any, output_type: Any, kwargs: dict[str, Any]
) -> dict[str, Any]:
    call = {_ALIASES.get(k, k): v for k, v in kwargs.items()}
    call.update(adapter.format_input(model_input))
    call["output_type"] = adapter.format_output_type(output_type)
    return call


def _texts(texts: list[str]) -> str | list[str]:
    return texts[0] if len(texts) == 1 else texts


# Outlines' Generator only accepts the black-box model classes it knows (an isinstance check
# on a fixed Union). A gengate model works exactly like a vLLM server model — the output type
# goes to a remote server as a constraint — so it registers as one and overrides every method.
class Gengate(VLLM):
    """An Outlines model served by gengate, over a blocking `Client`."""

    def __init__(self, client: Client, model_name: str) -> None:
        self.gengate_client = client
        self.model_name = model_name
        self.gengate_model = model_name
        self.type_adapter = GengateTypeAdapter()

    def generate(self, model_input: Any, output_type: Any = None, **inference_kwargs: Any) -> str | list[str]:
        """Text of the generation (a list when `n` > 1)."""
        call = _call_kwargs(self.type_adapter, model_input, output_type, inference_kwargs)
        return _texts(self.gengate_client.generate(self.gengate_model, **call).texts)

    def generate_batch(
        self, model_input: list[Any], output_type: Any = None, **inference_kwargs: Any
    ) -> list[Any]:
        """One BatchGenerate call; a failed item raises its error."""
        adapter = self.type_adapter
        requests = [
            {"model": self.gengate_model, **_call_kwargs(adapter, item, output_type, inference_kwargs)}
            for item in model_input
        ]
        return [_texts(item.unwrap().texts) for item in self.gengate_client.batch_generate(requests)]

    def generate_stream(
        self, model_input: Any, output_type: Any = None, **inference_kwargs: Any
    ) -> Iterator[str]:
        """Text deltas of the first generation."""
        call = _call_kwargs(self.type_adapter, model_input, output_type, inference_kwargs)
        for frame in self.gengate_client.generate_stream(self.gengate_model, **call):
            if isinstance(frame, StreamDelta) and frame.index == 0 and frame.text:
                yield frame.text


class AsyncGengate(AsyncVLLM):
    """An Outlines model served by gengate, over an `AsyncClient`."""

    def __init__(self, client: AsyncClient, model_name: str) -> None:
        self.gengate_client = client
        self.model_name = model_name
        self.gengate_model = model_name
        self.type_adapter = GengateTypeAdapter()

    async def generate(
        self, model_input: Any, output_type: Any = None, **inference_kwargs: Any
    ) -> str | list[str]:
        call = _call_kwargs(self.type_adapter, model_input, output_type, inference_kwargs)
        return _texts((await self.gengate_client.generate(self.gengate_model, **call)).texts)

    async def generate_batch(
        self, model_input: list[Any], output_type: Any = None, **inference_kwargs: Any
    ) -> list[Any]:
        adapter = self.type_adapter
        requests = [
            {"model": self.gengate_model, **_call_kwargs(adapter, item, output_type, inference_kwargs)}
            for item in model_input
        ]
        return [_texts(item.unwrap().texts) for item in await self.gengate_client.batch_generate(requests)]

    async def generate_stream(  # type: ignore[override]
        self, model_input: Any, output_type: Any = None, **inference_kwargs: Any
    ) -> AsyncIterator[str]:
        call = _call_kwargs(self.type_adapter, model_input, output_type, inference_kwargs)
        async for frame in self.gengate_client.generate_stream(self.gengate_model, **call):
            if isinstance(frame, StreamDelta) and frame.index == 0 and frame.text:
                yield frame.text


def from_gengate(client: Client | AsyncClient, model_name: str) -> Gengate | AsyncGengate:
    """An Outlines model for `model_name` served through `client` (async client → async model)."""
    if isinstance(client, AsyncClient):
        return AsyncGengate(client, model_name)
    return Gengate(client, model_name)
