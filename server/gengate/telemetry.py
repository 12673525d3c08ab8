"""OpenTelemetry for the server: where spans go, and a child span per backend call with GenAI attributes.

The RPC span comes from opentelemetry-instrumentation-grpc's server interceptor (api/server.py),
which continues the caller's trace from the `traceparent` metadata. Prompts and outputs are
recorded only when GENGATE_TRACE_CONTENT=1. `configure_tracing` installs an exporter from the
environment (GENGATE_TRACES_FILE, OTEL_EXPORTER_OTLP_ENDPOINT) unless the application already did;
its exporters get every span redacted (gengate.redaction), status messages and exceptions included.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import urllib.parse
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import IO, Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import Attributes

from gengate.caller import current_caller
from gengate.domain import GenerationEnd, GenerationRequest, GenerationResult
from gengate.errors import GengateError
from gengate.redaction import redact
from gengate.registry import KINDS

T = TypeVar("T")

log = logging.getLogger("gengate")
tracer = trace.get_tracer("gengate")


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file: a local exporter any test can read."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s)) + "\n" for s in spans)
        with self._lock:
            if self._file is None:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A span as plain JSON: ids in lowercase hex (as in `traceparent`), parent null for a root."""
    ctx = span.get_span_context()
    assert ctx is not None
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(span.parent.span_id, "016x") if span.parent is not None else None,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
        "service_name": span.resource.attributes.get(SERVICE_NAME),
    }


def _redacted_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, tuple | list):
        return tuple(redact(v) if isinstance(v, str) else v for v in value)
    return value


def _redacted_attributes(attributes: Attributes) -> dict[str, Any]:
    return {k: _redacted_value(v) for k, v in (attributes or {}).items()}


def redacted_span(span: ReadableSpan) -> ReadableSpan:
    """`span` with every string attribute (its events' too, e.g. exception.message and
    exception.stacktrace) and its status description redacted: what the exporters see."""
    status = span.status
    if status.description:
        status = Status(status.status_code, redact(status.description))
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=_redacted_attributes(span.attributes),
        events=[Event(e.name, _redacted_attributes(e.attributes), e.timestamp) for e in span.events],
        links=span.links,
        kind=span.kind,
        status=status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class RedactingSpanProcessor(SpanProcessor):
    """Hands `inner` each ended span redacted (gengate.redaction): gRPC's instrumentation puts
    the RPC's status message in the span status and exceptions in events, and no secret may
    leave the process through a trace."""

    def __init__(self, inner: SpanProcessor) -> None:
        self._inner = inner

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._inner.on_start(span, parent_context)  # type: ignore[arg-type]

    def on_end(self, span: ReadableSpan) -> None:
        self._inner.on_end(redacted_span(span))

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter | None:
    """The OTLP span exporter the OTEL_EXPORTER_OTLP_* variables ask for, if the extra `otel` is installed."""
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    try:
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            return HttpExporter()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    except ImportError:
        log.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp is not installed "
            "(pip install 'gengate[otel]'): spans are not exported"
        )
        return None


_configure_lock = threading.Lock()
_configured = False
_provider: TracerProvider | None = None


TRACE_EXPORTERS = ("otlp", "console", "none")


def trace_exporters(env: Mapping[str, str]) -> frozenset[str]:
    """OTEL_TRACES_EXPORTER (comma-separated: otlp, console, none; default otlp). Names it does not
    know are warned about and left out; `none` alone turns off OTLP and console export."""
    names = {n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()}
    unknown = sorted(names - set(TRACE_EXPORTERS))
    if unknown:
        log.warning(
            "OTEL_TRACES_EXPORTER: unknown exporter(s) %s ignored (known: %s)", unknown, TRACE_EXPORTERS
        )
    return frozenset(names & {"otlp", "console"})


def service_resource(env: Mapping[str, str]) -> Resource:
    """The resource spans carry: OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME as the SDK reads
    them, and service.name "gengate" only where neither names the service."""
    attributes: dict[str, str] = {}
    for pair in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            attributes[key.strip()] = urllib.parse.unquote(value.strip())
    if env.get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = env["OTEL_SERVICE_NAME"]
    attributes.setdefault(SERVICE_NAME, "gengate")
    return Resource.create(attributes)


def configure_tracing(env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Installs a tracer provider that exports where the environment says, once per process.

    GENGATE_TRACES_FILE=path: every span as a JSON line (SimpleSpanProcessor, written at span end).
    OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT), or OTEL_TRACES_EXPORTER naming otlp:
    OTLP, batched; OTEL_TRACES_EXPORTER=console: spans on stdout; =none: neither. Nothing set,
    OTEL_SDK_DISABLED, or a provider already installed by the embedding application: nothing is
    changed. Returns the provider installed here (to shut down at exit), else None.
    """
    global _configured, _provider
    env = os.environ if env is None else env
    with _configure_lock:
        if _configured:
            return _provider
        _configured = True
        traces_file = env.get("GENGATE_TRACES_FILE", "")
        exporters = trace_exporters(env)
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        named = "otlp" in {n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")}
        otlp = "otlp" in exporters and bool(endpoint or named)
        console = "console" in exporters
        if (not traces_file and not otlp and not console) or env.get(
            "OTEL_SDK_DISABLED", ""
        ).lower() == "true":
            return None
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            log.info("tracing: the application installed a tracer provider; gengate uses it as it is")
            return None
        provider = TracerProvider(resource=service_resource(env))
        targets: list[str] = []
        if traces_file:
            processor: SpanProcessor = SimpleSpanProcessor(JsonLinesSpanExporter(traces_file))
            provider.add_span_processor(RedactingSpanProcessor(processor))
            targets.append(f"file {traces_file}")
        exporter = _otlp_exporter(env) if otlp else None
        if exporter is not None:
            provider.add_span_processor(RedactingSpanProcessor(BatchSpanProcessor(exporter)))
            targets.append(f"OTLP {endpoint or 'default endpoint'}")
        if console:
            provider.add_span_processor(RedactingSpanProcessor(SimpleSpanProcessor(ConsoleSpanExporter())))
            targets.append("console")
        trace.set_tracer_provider(provider)
        _provider = provider
        log.info("tracing: spans go to %s", ", ".join(targets))
        return provider


def tracing_enabled() -> bool:
    """True once a tracer provider is installed (by configure_tracing, the application, or
    OTEL_PYTHON_TRACER_PROVIDER); until then every span would be a no-op."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def trace_content() -> bool:
    return os.environ.get("GENGATE_TRACE_CONTENT", "") == "1"


class BackendSpan:
    """Records a backend call's outcome on its span."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self._finish_reasons: list[str] = []
        self._output_tokens = 0

    def record_result(self, result: GenerationResult) -> None:
        if not self.span.is_recording():
            return
        self.span.set_attribute("gen_ai.usage.input_tokens", result.usage.input_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", result.usage.output_tokens)
        self.span.set_attribute(
            "gen_ai.response.finish_reasons", [g.finish_reason.value for g in result.generations]
        )
        self.span.set_attribute("gen_ai.response.id", result.request_id)
        self.span.set_attribute("gengate.enforcement", result.enforcement.value)
        if trace_content():
            self.span.set_attribute("gen_ai.output.messages", [redact(g.text) for g in result.generations])

    def record_end(self, end: GenerationEnd) -> None:
        if not self.span.is_recording():
            return
        self._finish_reasons.append(end.finish_reason.value)
        self._output_tokens += end.usage.output_tokens
        self.span.set_attribute("gen_ai.usage.input_tokens", end.usage.input_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", self._output_tokens)
        self.span.set_attribute("gen_ai.response.finish_reasons", self._finish_reasons)

    def events(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """`stream`, each item produced with this span current (a worker or provider call it
        starts is its child) but never held current across a yield: a stream dropped by its
        consumer is closed wherever the event loop closes it, and a context attached in one
        asyncio Context cannot be detached in another ("Failed to detach context")."""
        if not self.span.is_recording():
            return stream
        return self._events(stream)

    async def _events(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        while True:
            with trace.use_span(self.span, record_exception=False, set_status_on_exception=False):
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    return
            yield item


_NO_SPAN = BackendSpan(trace.INVALID_SPAN)


@contextlib.contextmanager
def backend_span(
    model: str, kind: str, request: GenerationRequest, *, current: bool = True
) -> Iterator[BackendSpan]:
    """A CLIENT-kind span around one call to `model` (a backend of `kind`), child of the current
    RPC span.

    `current`: the span is the current one inside the block (a unary call, awaited in one task).
    A stream passes False and produces its events through `BackendSpan.events` instead.
    With no tracer provider installed every span is a no-op: skip building one (and its
    attributes) altogether, which is most of this function's cost per request.
    """
    if not tracing_enabled():
        yield _NO_SPAN
        return
    operation = "chat" if request.messages is not None else "text_completion"
    attributes: dict[str, str | int | float] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": KINDS[kind].provider_name if kind in KINDS else kind,
        "gen_ai.request.model": model,
        "gengate.request.id": request.request_id,
        "gen_ai.request.choice.count": request.n,
        "gengate.caller": current_caller(),  # read here, in the core: the name, never a token
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
        attributes["gen_ai.input.messages"] = redact(request.prompt)
    span = tracer.start_span(f"{operation} {model}", kind=trace.SpanKind.CLIENT, attributes=attributes)
    scope = (
        trace.use_span(span, record_exception=False, set_status_on_exception=False)
        if current
        else contextlib.nullcontext()
    )
    try:
        with scope:
            yield BackendSpan(span)
    except GengateError as exc:
        span.set_attribute("error.type", redact(exc.reason))
        span.set_status(Status(StatusCode.ERROR, exc.code.value))
        raise
    except BaseException as exc:
        span.set_attribute("error.type", type(exc).__name__)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        span.end()
