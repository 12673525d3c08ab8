"""Metrics exported over OTLP: a real server with OTEL_EXPORTER_OTLP_ENDPOINT pointing at a local
OTLP receiver (HTTP/protobuf and gRPC), the export request decoded with OpenTelemetry's own
protos, the values equal to what the Prometheus endpoint says."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from metrics_scrape import scrape
from observe import ServerFactory

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.metric_exporter")
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)


class Receiver:
    """An OTLP receiver on 127.0.0.1: every ExportMetricsServiceRequest it was sent."""

    def __init__(self) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()

    def add(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self.lock:
            self.requests.append(request)

    def metrics(self) -> dict[str, Any]:
        """The last export's metrics by name."""
        assert self.requests, "nothing was exported"
        last = self.requests[-1]
        return {m.name: m for rm in last.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}

    def service_names(self) -> set[str]:
        return {
            a.value.string_value
            for request in self.requests
            for rm in request.resource_metrics
            for a in rm.resource.attributes
            if a.key == "service.name"
        }


@pytest.fixture(autouse=True)
def no_trace_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generic OTLP endpoint would also have start_server install a tracer provider for the
    whole test process (once per process): these tests are about metrics only."""
    import gengate.telemetry

    monkeypatch.setattr(gengate.telemetry, "_configured", True)


@pytest.fixture
def http_receiver() -> Iterator[tuple[Receiver, str]]:
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = metrics_service_pb2.ExportMetricsServiceRequest()
            request.ParseFromString(body)
            receiver.paths.append(self.path)
            receiver.add(request)
            reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield receiver, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[Receiver, str]]:
    receiver = Receiver()

    class Service(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            receiver.add(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(None)


async def _three_calls(address: str) -> int:
    output = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for prompt in ("a", "b", "c"):
            output += (await stub.Generate(g.GenerateRequest(model="m", prompt=prompt))).usage.output_tokens
    return output


def _attributes(point: Any) -> dict[str, str]:
    return {a.key: a.value.string_value for a in point.attributes}


async def test_metrics_go_to_an_otlp_http_receiver(
    make_server: ServerFactory, http_receiver: tuple[Receiver, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver, endpoint = http_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "3600000")  # only the export at stop
    server = await make_server(
        {
            "models": [{"name": "m", "backend": "scripted", "text": "one two"}],
            "server": {"metrics": {"port": 0}},
        }
    )
    assert server.metrics is not None and server.metrics.otlp is not None
    output = await _three_calls(server.address)
    scraped = await scrape(server)
    await server.stop(grace=0.5)  # exports once more, then shuts the exporter down
    assert receiver.paths and set(receiver.paths) == {"/v1/metrics"}
    assert receiver.service_names() == {"gengate"}
    metrics = receiver.metrics()

    duration = metrics["gen_ai.server.request.duration"]
    assert duration.unit == "s"
    (point,) = [p for p in duration.histogram.data_points if _attributes(p)["gen_ai.request.model"] == "m"]
    assert _attributes(point) == {
        "gen_ai.request.model": "m",
        "gen_ai.operation.name": "generate",
        "caller": "anonymous",
        "error.type": "",
    }
    assert point.count == 3 and not point.HasField("min")
    assert sum(point.bucket_counts) == 3 and len(point.bucket_counts) == len(point.explicit_bounds) + 1
    assert duration.histogram.aggregation_temporality == 2  # CUMULATIVE

    usage = metrics["gen_ai.client.token.usage"]
    assert usage.unit == "{token}"
    (output_point,) = [
        p for p in usage.histogram.data_points if _attributes(p)["gen_ai.token.type"] == "output"
    ]
    assert output_point.sum == output

    requests = metrics["gengate_requests"]
    assert requests.sum.is_monotonic
    values = {_attributes(p)["code"]: p.as_int or p.as_double for p in requests.sum.data_points}
    assert values == {"OK": 3}
    assert scraped.value("gengate_requests_total", model="m", code="OK") == 3  # the same counters

    in_flight = metrics["gengate_in_flight_requests"]
    assert {_attributes(p)["priority"] for p in in_flight.gauge.data_points} == {"interactive", "background"}
    assert "process_resident_memory" in metrics and metrics["process_resident_memory"].unit == "By"


async def test_metrics_go_to_an_otlp_grpc_receiver_without_a_prometheus_port(
    make_server: ServerFactory, grpc_receiver: tuple[Receiver, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.metric_exporter")
    receiver, endpoint = grpc_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", endpoint)  # the signal's own variable
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)  # grpc, the default
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "3600000")
    server = await make_server({"models": [{"name": "m", "backend": "scripted", "text": "one two"}]})
    assert server.metrics is not None and server.metrics_address is None  # OTLP only
    await _three_calls(server.address)
    await server.stop(grace=0.5)
    requests = receiver.metrics()["gengate_requests"]
    assert [p.as_double for p in requests.sum.data_points] == [3.0]


async def test_no_otlp_export_when_metrics_are_turned_off(
    make_server: ServerFactory, http_receiver: tuple[Receiver, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver, endpoint = http_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")  # traces may still go there
    server = await make_server({"models": [{"name": "m", "backend": "scripted"}]})
    assert server.metrics is None
    await server.stop(grace=0.5)
    assert receiver.requests == []
