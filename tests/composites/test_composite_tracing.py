"""Member calls are spans under the composite's span; the fallback names the member that answered."""

from __future__ import annotations

import pytest
from composite_members import KIND, CoreFactory
from gengate.domain import ChatMessage, GenerationRequest, Role, TextPart
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@pytest.fixture(scope="session")
def spans() -> InMemorySpanExporter:
    """Every span of this process also goes to an in-memory exporter (one SDK provider per process)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    assert isinstance(trace.get_tracer_provider(), TracerProvider), "a non-SDK provider is installed"
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory


def trace_of(exporter: InMemorySpanExporter, request_id: str) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The composite's span (by request id) and the spans directly under it."""
    finished = exporter.get_finished_spans()
    (top,) = [s for s in finished if (s.attributes or {}).get("gengate.request.id") == request_id]
    top_id = top.get_span_context().span_id  # type: ignore[union-attr]
    return top, [s for s in finished if s.parent is not None and s.parent.span_id == top_id]


async def test_fallback_and_mixture_spans(make_core: CoreFactory, spans: InMemorySpanExporter) -> None:
    core = await make_core(
        [
            {"name": "down", "backend": KIND, "fail": "UNAVAILABLE"},
            {"name": "up", "backend": KIND, "text": "fine"},
            {"name": "fb", "backend": "fallback", "models": ["down", "up"]},
            {"name": "moa", "backend": "mixture_of_agents", "proposers": ["up", "down"], "aggregator": "fb"},
        ]
    )
    await core.generate(GenerationRequest(model="fb", prompt="q", request_id="fb-call"))
    top, children = trace_of(spans, "fb-call")
    assert (top.attributes or {})["gengate.fallback.member"] == "up"
    assert (top.attributes or {})["gengate.fallback.attempts"] == 2
    assert [(c.name, (c.attributes or {}).get("error.type")) for c in children] == [
        ("text_completion down", "UNAVAILABLE"),
        ("text_completion up", None),
    ]
    assert (children[1].attributes or {})["gengate.request.id"] == "fb-call.f1"

    chat = (ChatMessage(Role.USER, (TextPart("q"),)),)
    await core.generate(GenerationRequest(model="moa", messages=chat, request_id="moa-call"))
    top, children = trace_of(spans, "moa-call")
    assert (top.attributes or {})["gengate.moa.proposals"] == 1
    assert (top.attributes or {})["gengate.moa.failed_proposals"] == 1
    assert sorted(c.name for c in children) == ["chat down", "chat fb", "chat up"]
    (aggregator,) = [c for c in children if c.name == "chat fb"]
    _, under_aggregator = trace_of(spans, "moa-call.agg")
    assert aggregator.get_span_context() is not None
    assert [c.name for c in under_aggregator] == ["chat down", "chat up"]
