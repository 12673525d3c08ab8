"""OpenTelemetry for the server: a child span per backend call with the GenAI attributes.

The RPC span comes from opentelemetry-instrumentation-grpc's server interceptor (api/server.py),
which continues the caller's trace from the `traceparent` metadata. Prompts and outputs are
recorded only when GENGATE_TRACE_CONTENT=1.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from gengate.domain import GenerationEnd, GenerationRequest, GenerationResult
from gengate.errors import GengateError

if TYPE_CHECKING:
    from gengate.router import Route

tracer = trace.get_tracer("gengate")

_PROVIDER_NAMES = {
    "llamacpp": "llama.cpp",
    "transformers": "transformers",
    "vllm": "vllm",
    "scripted": "gengate.scripted",
    "openai": "openai",
    "azure_openai": "azure.ai.openai",
    "anthropic": "anthropic",
    "cohere": "cohere",
    "mistral": "mistral_ai",
    "gemini": "gcp.gemini",
    "tgi": "huggingface.tgi",
    "ollama": "ollama",
    "litellm": "litellm",
}


def trace_content() -> bool:
    return os.environ.get("GENGATE_TRACE_CONTENT", "") == "1"


class BackendSpan:
    """Records a backend call's outcome on its span."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self._finish_reasons: list[str] = []
        self._output_tokens = 0

    def record_result(self, result: GenerationResult) -> None:
        self.span.set_attribute("gen_ai.usage.input_tokens", result.usage.input_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", result.usage.output_tokens)
        self.span.set_attribute(
            "gen_ai.response.finish_reasons", [g.finish_reason.value for g in result.generations]
        )
        self.span.set_attribute("gen_ai.response.id", result.request_id)
        self.span.set_attribute("gengate.enforcement", result.enforcement.value)
        if trace_content():
            self.span.set_attribute("gen_ai.output.messages", [g.text for g in result.generations])

    def record_end(self, end: GenerationEnd) -> None:
        self._finish_reasons.append(end.finish_reason.value)
        self._output_tokens += end.usage.output_tokens
        self.span.set_attribute("gen_ai.usage.input_tokens", end.usage.input_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", self._output_tokens)
        self.span.set_attribute("gen_ai.response.finish_reasons", self._finish_reasons)


@contextlib.contextmanager
def backend_span(route: Route, request: GenerationRequest) -> Iterator[BackendSpan]:
    """A CLIENT-kind span around one backend call, child of the current RPC span."""
    operation = "chat" if request.messages is not None else "text_completion"
    attributes: dict[str, str | int | float] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": _PROVIDER_NAMES.get(route.config.backend, route.config.backend),
        "gen_ai.request.model": route.name,
        "gengate.request.id": request.request_id,
        "gen_ai.request.choice.count": request.n,
    }
    sampling = request.sampling
    for key, value in (
        ("gen_ai.request.temperature", sampling.temperature),
        ("gen_ai.request.top_p", sampling.top_p),
        ("gen_ai.request.top_k", sampling.top_k),
        ("gen_ai.request.seed", sampling.seed),
        ("gen_ai.request.max_tokens", request.stopping.max_tokens),
    ):
        if value is not None:
            attributes[key] = value
    if request.structured_output is not None:
        attributes["gengate.constraint.kind"] = request.structured_output.constraint.kind.value
    if trace_content() and request.prompt is not None:
        attributes["gen_ai.input.messages"] = request.prompt
    with tracer.start_as_current_span(
        f"{operation} {route.name}",
        kind=trace.SpanKind.CLIENT,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield BackendSpan(span)
        except GengateError as exc:
            span.set_attribute("error.type", exc.reason)
            span.set_status(Status(StatusCode.ERROR, exc.code.value))
            raise
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__name__)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
