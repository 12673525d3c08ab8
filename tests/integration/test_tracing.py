"""One trace from the caller through the server into the backend: client span → RPC span → backend span.

The global tracer provider can be set once per process, so the in-process tests share one SDK
provider with an in-memory exporter (session fixture); configure_tracing's own exporters (file,
OTLP) are tested in subprocesses, on the real `gengate serve`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from gengate.api.server import RunningServer
from gengate_client import AsyncClient, Client, StreamEnd, StreamStart
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

PROMPT = "CANARY-prompt-7731 tell me a story"
REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
ServerFactory = Callable[[dict[str, Any]], Awaitable[RunningServer]]


@pytest.fixture(scope="session")
def exporter() -> InMemorySpanExporter:
    """Every span of this process also goes to an in-memory exporter (one SDK provider per process)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    assert isinstance(trace.get_tracer_provider(), TracerProvider), "a non-SDK provider is installed"
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory


async def _chain(
    exporter: InMemorySpanExporter, caller: trace.Span
) -> tuple[list[ReadableSpan], ReadableSpan, ReadableSpan]:
    """The caller's trace: all its spans, the server RPC span under the caller's span, and the one
    backend span under that. Polls: the RPC span may end just after the caller has its reply."""
    ctx = caller.get_span_context()
    for _ in range(100):
        spans = [
            s
            for s in exporter.get_finished_spans()
            if s.context is not None and s.context.trace_id == ctx.trace_id
        ]
        servers = [s for s in spans if s.kind == SpanKind.SERVER]
        if servers:
            break
        await asyncio.sleep(0.02)
    assert len(servers) == 1, [(s.name, s.kind) for s in spans]
    server = servers[0]
    assert server.parent is not None and server.parent.span_id == ctx.span_id and server.parent.is_remote
    assert server.context is not None
    backends = [s for s in spans if s.parent is not None and s.parent.span_id == server.context.span_id]
    assert len(backends) == 1, [(s.name, s.parent) for s in spans]
    assert backends[0].kind == SpanKind.CLIENT
    return spans, server, backends[0]


def _no_prompt_anywhere(spans: Sequence[ReadableSpan]) -> None:
    for span in spans:
        for key, value in (span.attributes or {}).items():
            assert "CANARY" not in str(value), f"prompt text in {span.name} {key}"


@pytest.mark.parametrize(
    ("config", "provider"),
    [
        ({"name": "m", "backend": "scripted", "tokens_per_s": 2000}, "gengate.scripted"),
        ({"name": "m", "backend": "llamacpp", "tiny": True}, "llama.cpp"),
    ],
    ids=["scripted", "llamacpp"],
)
async def test_unary_and_stream_form_one_trace(
    make_server: ServerFactory, exporter: InMemorySpanExporter, config: dict[str, Any], provider: str
) -> None:
    if config["backend"] == "llamacpp":
        pytest.importorskip("llama_cpp")
    server = await make_server({"models": [config]})
    tracer = trace.get_tracer("test")
    async with AsyncClient(server.address) as client:
        with tracer.start_as_current_span("caller", kind=SpanKind.CLIENT) as caller:
            response = await client.generate("m", PROMPT, max_tokens=6, seed=3)
        spans, rpc, backend = await _chain(exporter, caller)
        assert rpc.name.endswith("gengate.v1.GenerationService/Generate")
        attrs = backend.attributes or {}
        assert attrs["gen_ai.operation.name"] == "text_completion"
        assert attrs["gen_ai.provider.name"] == provider
        assert attrs["gen_ai.request.model"] == "m"
        assert attrs["gen_ai.request.max_tokens"] == 6
        assert attrs["gen_ai.request.seed"] == 3
        assert attrs["gen_ai.usage.input_tokens"] == response.usage.input_tokens > 0
        assert attrs["gen_ai.usage.output_tokens"] == response.usage.output_tokens > 0
        assert list(attrs["gen_ai.response.finish_reasons"]) == [
            g.finish_reason.value.lower() for g in response.generations
        ]
        assert attrs["gen_ai.response.id"] == response.request_id
        _no_prompt_anywhere(spans)

        with tracer.start_as_current_span("caller-stream", kind=SpanKind.CLIENT) as caller:
            frames = [f async for f in client.generate_stream("m", PROMPT, max_tokens=6, seed=3, n=2)]
        spans, rpc, backend = await _chain(exporter, caller)
        assert rpc.name.endswith("gengate.v1.GenerationService/GenerateStream")
        ends = [f for f in frames if isinstance(f, StreamEnd)]
        start = next(f for f in frames if isinstance(f, StreamStart))
        attrs = backend.attributes or {}
        assert attrs["gen_ai.request.choice.count"] == 2
        assert attrs["gen_ai.usage.input_tokens"] == start.input_tokens > 0
        assert attrs["gen_ai.usage.output_tokens"] == sum(e.usage.output_tokens for e in ends) > 0
        assert sorted(attrs["gen_ai.response.finish_reasons"]) == sorted(
            e.finish_reason.value.lower() for e in ends
        )
        _no_prompt_anywhere(spans)


async def test_prompt_and_output_are_recorded_only_when_asked(
    make_server: ServerFactory, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await make_server({"models": [{"name": "m", "backend": "scripted", "tokens_per_s": 2000}]})
    monkeypatch.setenv("GENGATE_TRACE_CONTENT", "1")
    async with AsyncClient(server.address) as client:
        with trace.get_tracer("test").start_as_current_span("caller") as caller:
            response = await client.generate("m", PROMPT, max_tokens=4)
    _, _, backend = await _chain(exporter, caller)
    attrs = backend.attributes or {}
    assert attrs["gen_ai.input.messages"] == PROMPT
    assert list(attrs["gen_ai.output.messages"]) == response.texts


# --- configure_tracing's exporters, in their own processes (the global provider is per process) ---


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """Starts `gengate serve` (scripted model) with extra environment; stops it with SIGTERM."""
    procs: list[subprocess.Popen[str]] = []

    def start(env: dict[str, str]) -> tuple[str, subprocess.Popen[str]]:
        config = tmp_path / "config.yaml"
        config.write_text("models:\n  - name: m\n    backend: scripted\n    tokens_per_s: 2000\n")
        port = _free_port()
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "GENGATE_TRACE"))}
        proc = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "gengate",
                "serve",
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env={**full_env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        procs.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            if "serving on" in line:
                break
        else:
            pytest.fail(f"server did not start: {proc.wait()}")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
        return f"127.0.0.1:{port}", proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_traces_file_from_gengate_serve(serve: Any, tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    address, proc = serve({"GENGATE_TRACES_FILE": str(path)})
    caller_tracer = TracerProvider().get_tracer("caller")  # the caller's own provider, not this process's
    with (
        caller_tracer.start_as_current_span("caller", kind=SpanKind.CLIENT) as caller,
        Client(address) as client,
    ):
        response = client.generate("m", PROMPT, max_tokens=5)
    _stop(proc)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    trace_id = format(caller.get_span_context().trace_id, "032x")
    mine = [r for r in records if r["trace_id"] == trace_id]
    server = next(r for r in mine if r["kind"] == "SERVER")
    assert server["parent_span_id"] == format(caller.get_span_context().span_id, "016x")
    assert server["name"].endswith("GenerationService/Generate")
    assert server["service_name"] == "gengate"
    backend = next(r for r in mine if r["parent_span_id"] == server["span_id"])
    assert backend["kind"] == "CLIENT"
    assert backend["attributes"]["gen_ai.usage.output_tokens"] == response.usage.output_tokens
    assert backend["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
    assert "CANARY" not in path.read_text()


def test_otlp_exporter_from_gengate_serve(serve: Any) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[Any] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    try:
        address, proc = serve({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"})
        with Client(address) as client:
            client.generate("m", PROMPT, max_tokens=3)
        _stop(proc)  # the batch processor flushes at shutdown
    finally:
        collector.stop(None)
    spans = [
        (rs, span)
        for request in received
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    names = {span.name for _, span in spans}
    assert any(n.endswith("GenerationService/Generate") for n in names), names
    assert "text_completion m" in names
    service = {
        a.value.string_value for rs, _ in spans for a in rs.resource.attributes if a.key == "service.name"
    }
    assert service == {"gengate"}


def test_an_application_provider_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    code = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from gengate.telemetry import configure_tracing
mine = TracerProvider()
trace.set_tracer_provider(mine)
assert configure_tracing() is None
assert trace.get_tracer_provider() is mine
with trace.get_tracer("x").start_as_current_span("s"):
    pass
"""
    env = {**os.environ, "GENGATE_TRACES_FILE": str(path)}
    subprocess.run([PYTHON, "-c", code], env=env, check=True, cwd=REPO, timeout=60)
    assert not path.exists()


def test_nothing_is_installed_without_configuration() -> None:
    code = """
from opentelemetry import trace
from gengate.telemetry import configure_tracing
assert configure_tracing({}) is None
assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
"""
    subprocess.run([PYTHON, "-c", code], check=True, cwd=REPO, timeout=60)


def test_span_records_are_one_json_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    code = """
import sys
from opentelemetry import trace
from gengate.telemetry import configure_tracing
provider = configure_tracing({"GENGATE_TRACES_FILE": sys.argv[1]})
tracer = trace.get_tracer("x")
with tracer.start_as_current_span("outer", attributes={"list": [1, 2]}):
    with tracer.start_as_current_span("inner", kind=trace.SpanKind.CLIENT):
        pass
provider.shutdown()
"""
    started = time.time_ns()
    subprocess.run([PYTHON, "-c", code, str(path)], check=True, cwd=REPO, timeout=60)
    inner, outer = (json.loads(line) for line in path.read_text().splitlines())
    assert (inner["name"], inner["kind"], outer["kind"]) == ("inner", "CLIENT", "INTERNAL")
    assert inner["trace_id"] == outer["trace_id"] and len(inner["trace_id"]) == 32
    assert inner["parent_span_id"] == outer["span_id"] and len(outer["span_id"]) == 16
    assert outer["parent_span_id"] is None
    assert outer["attributes"] == {"list": [1, 2]}
    assert outer["status"] == "UNSET" and outer["service_name"] == "gengate"
    assert started <= outer["start_time_unix_nano"] <= inner["start_time_unix_nano"]


async def test_a_stream_cancelled_by_its_caller_ends_its_spans_without_context_errors(
    make_server: ServerFactory, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    """A server stream dropped while the server waits to write used to be closed by the event
    loop in another Context than the one its spans were attached in: "Failed to detach context"
    (an ERROR log) per cancelled stream, from the RPC span and from the backend span."""
    # More than flow control lets through unread, even as merged frames (api/coalesce.py)
    text = "word " * 1_000_000
    server = await make_server({"models": [{"name": "m", "backend": "scripted", "text": text}]})
    caplog.set_level(logging.ERROR, logger="opentelemetry.context")
    async with AsyncClient(server.address) as client:
        for attempt in range(3):
            with trace.get_tracer("test").start_as_current_span(f"caller-{attempt}") as caller:
                frames = client.generate_stream("m", PROMPT, max_tokens=1_000_000)
                async for frame in frames:
                    if isinstance(frame, StreamStart):
                        break
                await asyncio.sleep(0.3)  # not reading: the server blocks writing its frames
                await frames.aclose()  # cancels the RPC mid-stream
        assert (await client.generate("m", PROMPT, max_tokens=2)).usage.output_tokens == 2
    for _ in range(50):
        gc.collect()
        _, rpc, backend = await _chain(exporter, caller)
        if rpc.end_time and backend.end_time:
            break
        await asyncio.sleep(0.05)
    assert backend.status.status_code is StatusCode.ERROR  # cancelled: not a success
    detach_errors = [r.getMessage() for r in caplog.records if r.name == "opentelemetry.context"]
    assert detach_errors == []


def test_otel_resource_attributes_name_the_service(tmp_path: Path) -> None:
    """OTEL_RESOURCE_ATTRIBUTES' service.name (and its other attributes) reach the spans; gengate's
    own name is only the default."""
    path = tmp_path / "spans.jsonl"
    code = """
import sys
from opentelemetry import trace
from gengate.telemetry import configure_tracing
attributes = "service.name=llm-gateway,deployment.environment=prod%2Deu"
provider = configure_tracing({"GENGATE_TRACES_FILE": sys.argv[1], "OTEL_RESOURCE_ATTRIBUTES": attributes})
with trace.get_tracer("x").start_as_current_span("s"):
    pass
print(dict(provider.resource.attributes)["deployment.environment"])
provider.shutdown()
"""
    out = subprocess.run(
        [PYTHON, "-c", code, str(path)], check=True, cwd=REPO, timeout=60, capture_output=True, text=True
    )
    assert out.stdout.strip() == "prod-eu"
    (record,) = (json.loads(line) for line in path.read_text().splitlines())
    assert record["service_name"] == "llm-gateway"


@pytest.mark.parametrize(
    ("exporter", "on_stdout"),
    [("console", True), ("none", False), ("console,bogus", True)],
)
def test_otel_traces_exporter_picks_the_exporters(exporter: str, on_stdout: bool) -> None:
    code = """
import os
from opentelemetry import trace
from gengate.telemetry import configure_tracing
provider = configure_tracing({"OTEL_TRACES_EXPORTER": os.environ["EXPORTER"],
                              "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
with trace.get_tracer("x").start_as_current_span("console-span"):
    pass
print("installed" if provider is not None else "none")
if provider is not None:
    provider.shutdown()
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | {"EXPORTER": exporter}
    out = subprocess.run(
        [PYTHON, "-c", code], check=True, cwd=REPO, timeout=60, capture_output=True, text=True, env=env
    )
    assert ('"name": "console-span"' in out.stdout) is on_stdout, out.stdout
    # `none` turns OTLP off although an endpoint is set: no provider at all
    assert out.stdout.strip().endswith("installed" if on_stdout else "none")
    if exporter == "console,bogus":
        assert "bogus" in out.stderr
