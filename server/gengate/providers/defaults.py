"""Default provider models registered with no config file, one per provider whose standard
API-key variable is set and whose SDK is installed."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DefaultProvider:
    """A provider's default model: registered when one of `key_envs` is set and `sdk` imports."""

    name: str
    backend: str
    model: str
    key_envs: tuple[str, ...]
    sdk: str


DEFAULT_PROVIDERS: tuple[DefaultProvider, ...] = (
    DefaultProvider("openai", "openai", "gpt-4o-mini", ("OPENAI_API_KEY",), "openai"),
    DefaultProvider("anthropic", "anthropic", "claude-3-5-haiku-latest", ("ANTHROPIC_API_KEY",), "anthropic"),
    DefaultProvider("cohere", "cohere", "command-r-plus", ("CO_API_KEY", "COHERE_API_KEY"), "cohere"),
    DefaultProvider("mistral", "mistral", "mistral-small-latest", ("MISTRAL_API_KEY",), "mistralai"),
    DefaultProvider(
        "gemini", "gemini", "gemini-2.0-flash", ("GEMINI_API_KEY", "GOOGLE_API_KEY"), "google.genai"
    ),
    DefaultProvider("groq", "groq", "llama-3.1-8b-instant", ("GROQ_API_KEY",), "openai"),
    DefaultProvider(
        "together", "together", "meta-llama/Llama-3.3-70B-Instruct-Turbo", ("TOGETHER_API_KEY",), "openai"
    ),
)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def default_provider_entries(env: Mapping[str, str]) -> list[dict[str, Any]]:
    """Config entries (as in the YAML `models:` list) for providers whose key variable is set.

    The entry names the variable (`api_key_env`), never the key itself."""
    entries: list[dict[str, Any]] = []
    for p in DEFAULT_PROVIDERS:
        key_env = next((k for k in p.key_envs if env.get(k)), None)
        if key_env is None or not _importable(p.sdk):
            continue
        entries.append({"name": p.name, "backend": p.backend, "model": p.model, "api_key_env": key_env})
    return entries
