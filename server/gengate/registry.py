"""Backend kinds by config name, imported lazily so torch & co load only when configured."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel

from gengate.backend import Backend
from gengate.errors import ConfigError

# kind -> "module:Class". A backend class has `kind`, `Options` (a pydantic model with
# extra="forbid" holding its own config keys) and `__init__(name, options)`.
BACKEND_CLASSES: dict[str, str] = {
    "scripted": "gengate.engines.scripted:ScriptedBackend",
    "llamacpp": "gengate.engines.llamacpp:LlamaCppBackend",
    "transformers": "gengate.engines.transformers:TransformersBackend",
    "vllm": "gengate.engines.vllm:VLLMBackend",
    "openai": "gengate.providers.openai:OpenAIBackend",
    "azure_openai": "gengate.providers.openai:AzureOpenAIBackend",
    "ollama": "gengate.providers.ollama:OllamaBackend",
    "openai_compatible": "gengate.providers.openai:OpenAICompatibleBackend",
    "together": "gengate.providers.openai:TogetherBackend",
    "groq": "gengate.providers.openai:GroqBackend",
    "anyscale": "gengate.providers.openai:AnyscaleBackend",
    "vllm_server": "gengate.providers.openai:VLLMServerBackend",
    "sglang": "gengate.providers.openai:SGLangBackend",
    "llamacpp_server": "gengate.providers.openai:LlamaCppServerBackend",
    "anthropic": "gengate.providers.anthropic:AnthropicBackend",
    "cohere": "gengate.providers.cohere:CohereBackend",
    "mistral": "gengate.providers.mistral:MistralBackend",
    "gemini": "gengate.providers.gemini:GeminiBackend",
    "tgi": "gengate.providers.tgi:TGIBackend",
    "litellm": "gengate.providers.litellm:LiteLLMBackend",
    "fallback": "gengate.composites.fallback:FallbackBackend",
    "mixture_of_agents": "gengate.composites.mixture:MixtureOfAgentsBackend",
    "preset": "gengate.composites.preset:PresetBackend",
}


# The optional extra that installs a kind's SDK, where it is not named after the kind.
BACKEND_EXTRAS: dict[str, str] = {
    "azure_openai": "openai",
    "openai_compatible": "openai",
    "together": "openai",
    "groq": "openai",
    "anyscale": "openai",
    "vllm_server": "openai",
    "sglang": "openai",
    "llamacpp_server": "openai",
}


class BackendClass(Protocol):
    """What the registry needs of a backend class."""

    kind: ClassVar[str]
    Options: ClassVar[type[BaseModel]]

    def __call__(self, name: str, options: Any) -> Backend: ...


def backend_class(kind: str) -> Any:
    """Imports and returns the class serving `kind`; ConfigError when unknown or not installed."""
    target = BACKEND_CLASSES.get(kind)
    if target is None:
        known = ", ".join(sorted(BACKEND_CLASSES))
        raise ConfigError(f"unknown backend {kind!r} (known: {known})")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"backend {kind!r} is not available: {exc}. "
            + (
                "vLLM has its own stack: see bench/gpu/README.md"
                if kind == "vllm"
                else f"Install its extra: pip install 'gengate[{BACKEND_EXTRAS.get(kind, kind)}]'"
            )
        ) from exc
    return getattr(module, class_name)
