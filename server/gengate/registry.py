"""Every backend kind's facts in one row (`KindSpec`): the registry, the worker factory, tracing
and the zero-config defaults all read this table. Classes are imported lazily, so torch & co
load only when configured."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

from pydantic import BaseModel

from gengate.backend import Backend
from gengate.errors import ConfigError

Role = Literal["engine", "provider", "composite"]


@dataclass(frozen=True)
class KindSpec:
    """What gengate knows about one `backend:` kind before importing its class."""

    kind: str
    target: str  # "module:Class": has `kind`, `Options` (pydantic, extra="forbid"), __init__(name, options)
    role: Role
    extra: str | None = None  # the pip extra installing its SDK (`gengate[extra]`)
    genai_provider: str | None = None  # `gen_ai.provider.name` on its spans (OTel GenAI conventions)
    key_envs: tuple[str, ...] = ()  # standard API-key variables, read when the config names no key
    process_by_default: bool = False  # runs in a worker process unless `isolation: inline`
    gpu_by_default: bool = False  # needs placed GPUs unless `devices: cpu`
    cpu_threaded: bool = False  # `cpu_threads` sets its compute threads
    default_model: str | None = None  # registered with no config file when a key variable is set
    sdk: str | None = None  # the module that must import for that zero-config registration

    @property
    def provider_name(self) -> str:
        return self.genai_provider or self.kind


def _engine(kind: str, target: str, provider: str, **facts: Any) -> KindSpec:
    return KindSpec(kind, target, "engine", genai_provider=provider, **facts)


def _provider(kind: str, cls: str, **facts: Any) -> KindSpec:
    module = facts.pop("module", kind)
    return KindSpec(kind, f"gengate.providers.{module}:{cls}", "provider", **facts)


def _openai_family(kind: str, cls: str, **facts: Any) -> KindSpec:
    """An OpenAI-compatible host: the openai SDK (extra `openai`), the OpenAI wire protocol."""
    facts.setdefault("genai_provider", kind)
    facts.setdefault("module", "openai")
    facts.setdefault("extra", "openai")
    return _provider(kind, cls, sdk="openai", **facts)


KINDS: dict[str, KindSpec] = {
    spec.kind: spec
    for spec in (
        _engine("scripted", "gengate.engines.scripted:ScriptedBackend", "gengate.scripted"),
        _engine(
            "llamacpp", "gengate.engines.llamacpp:LlamaCppBackend", "llama.cpp",
            extra="llamacpp", process_by_default=True, cpu_threaded=True,
        ),
        _engine(
            "transformers", "gengate.engines.transformers:TransformersBackend", "transformers",
            extra="transformers", process_by_default=True, cpu_threaded=True,
        ),
        _engine(
            "mlx", "gengate.engines.mlx:MlxBackend", "mlx",
            extra="mlx", process_by_default=True, cpu_threaded=True,
        ),
        _engine(
            "vllm", "gengate.engines.vllm:VLLMBackend", "vllm",
            extra="vllm", process_by_default=True, gpu_by_default=True,
        ),
        _openai_family(
            "openai", "OpenAIBackend", key_envs=("OPENAI_API_KEY",), default_model="gpt-4o-mini"
        ),
        _openai_family(
            "azure_openai", "AzureOpenAIBackend",
            genai_provider="azure.ai.openai", key_envs=("AZURE_OPENAI_API_KEY",),
        ),
        _openai_family("openai_compatible", "OpenAICompatibleBackend"),
        _openai_family(
            "together", "TogetherBackend",
            key_envs=("TOGETHER_API_KEY",), default_model="meta-llama/Llama-3.3-70B-Instruct-Turbo",
        ),
        _openai_family(
            "groq", "GroqBackend", key_envs=("GROQ_API_KEY",), default_model="llama-3.1-8b-instant"
        ),
        _openai_family("anyscale", "AnyscaleBackend", key_envs=("ANYSCALE_API_KEY",)),
        _openai_family("vllm_server", "VLLMServerBackend", genai_provider="vllm"),
        _openai_family("sglang", "SGLangBackend"),
        _openai_family("llamacpp_server", "LlamaCppServerBackend", genai_provider="llama.cpp"),
        _openai_family("ollama", "OllamaBackend", module="ollama", extra="ollama"),
        _provider(
            "anthropic", "AnthropicBackend",
            extra="anthropic", sdk="anthropic", key_envs=("ANTHROPIC_API_KEY",),
            default_model="claude-3-5-haiku-latest",
        ),
        _provider(
            "cohere", "CohereBackend",
            extra="cohere", sdk="cohere", key_envs=("CO_API_KEY", "COHERE_API_KEY"),
            default_model="command-r-plus",
        ),
        _provider(
            "mistral", "MistralBackend",
            extra="mistral", sdk="mistralai", genai_provider="mistral_ai", key_envs=("MISTRAL_API_KEY",),
            default_model="mistral-small-latest",
        ),
        _provider(
            "gemini", "GeminiBackend",
            extra="gemini", sdk="google.genai", genai_provider="gcp.gemini",
            key_envs=("GEMINI_API_KEY", "GOOGLE_API_KEY"), default_model="gemini-2.0-flash",
        ),
        _provider(
            "tgi", "TGIBackend",
            extra="tgi", sdk="huggingface_hub", genai_provider="huggingface.tgi", key_envs=("HF_TOKEN",),
        ),
        _provider("litellm", "LiteLLMBackend", extra="litellm", sdk="litellm"),
        KindSpec("fallback", "gengate.composites.fallback:FallbackBackend", "composite"),
        KindSpec("mixture_of_agents", "gengate.composites.mixture:MixtureOfAgentsBackend", "composite"),
        KindSpec("preset", "gengate.composites.preset:PresetBackend", "composite"),
    )
}  # fmt: skip


class BackendClass(Protocol):
    """What the registry needs of a backend class: its kind, its options model, a constructor."""

    kind: str
    Options: type[BaseModel]

    def __call__(self, name: str, options: Any) -> Backend: ...


def kind_spec(kind: str) -> KindSpec:
    """The row for `kind`; ConfigError naming the known kinds when there is none."""
    spec = KINDS.get(kind)
    if spec is None:
        raise ConfigError(f"unknown backend {kind!r} (known: {', '.join(sorted(KINDS))})")
    return spec


def kinds_where(role: Role | None = None, **facts: bool) -> frozenset[str]:
    """The kinds with `role` (any role when None) and every given flag set as given."""
    return frozenset(
        s.kind
        for s in KINDS.values()
        if (role is None or s.role == role) and all(getattr(s, k) == v for k, v in facts.items())
    )


def backend_class(kind: str) -> BackendClass:
    """Imports and returns the class serving `kind`; ConfigError when unknown or not installed."""
    spec = kind_spec(kind)
    module_name, _, class_name = spec.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        remedy = (
            "vLLM has its own stack: see bench/gpu/README.md"
            if kind == "vllm"
            else f"Install its extra: pip install 'gengate[{spec.extra or kind}]'"
        )
        raise ConfigError(f"backend {kind!r} is not available: {exc}. {remedy}") from exc
    return cast(BackendClass, getattr(module, class_name))
