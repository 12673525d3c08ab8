"""Ollama through its OpenAI-compatible endpoint (`<host>/v1`), driven by the `openai` SDK.

Chosen over the `ollama` SDK's /api/chat so Ollama shares the one chat-completions adapter,
its retries, usage and error mapping. Ollama's endpoint maps `response_format` json_schema to
its native `format` (JSON Schema enforced by its grammar sampler), so JSON Schema, JSON object
and choices (a string enum) are native; regex is prompted and validated; grammars are refused.
Ollama answers one choice per request, so `n` is fanned out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from gengate.domain import ConstraintKind, Enforcement
from gengate.providers.openai import OpenAICompatibleBackend


class OllamaBackend(OpenAICompatibleBackend):
    """A model served by Ollama (default http://localhost:11434/v1, no key needed)."""

    kind: ClassVar[str] = "ollama"
    label: ClassVar[str] = "Ollama"
    default_base_url = "http://localhost:11434/v1"
    structured_support: ClassVar[Mapping[ConstraintKind, Enforcement]] = {
        ConstraintKind.JSON_SCHEMA: Enforcement.NATIVE,
        ConstraintKind.JSON_OBJECT: Enforcement.NATIVE,
        ConstraintKind.CHOICE: Enforcement.NATIVE,
        ConstraintKind.REGEX: Enforcement.VALIDATED,
    }
    native_n = False
    logprobs_supported = False
    max_top_logprobs = 0
    image_input = True
    seed_supported = True
