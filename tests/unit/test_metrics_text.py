"""The metrics endpoint writes the recorded families itself: the same bytes prometheus_client
writes, and prometheus_client's own answer for every scrape that is not plain text."""

from __future__ import annotations

import gzip
import urllib.request

from gengate.config import ModelPrice
from gengate.metrics import ServerMetrics
from gengate.metrics.families import Metrics
from gengate.observation import RequestOutcome
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def _record(metrics: Metrics) -> None:
    metrics.succeeded("generate", "m", "team-a", 0.003, 12, 40, 4, (0.001, 0.002), "json_schema", "native")
    metrics.succeeded("generate_stream", "m", "team-a", 2.5, 3, 1, 0, (), None, None, 0.02)
    # label values the text format must escape: backslash, newline, double quote
    metrics.request_done(RequestOutcome("generate", 'we"ird\\mo\ndel', "b", "INVALID_ARGUMENT", 0.5))
    metrics.request_done(
        RequestOutcome("generate", "m", "team-a", "DEADLINE_EXCEEDED", 30.0, time_to_first_token_s=1e-7)
    )


def test_the_recorded_families_are_written_byte_for_byte_as_prometheus_client_writes_them() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, {"m": ModelPrice(input_per_million=1.5, output_per_million=6.0)})
    assert metrics.text() == generate_latest(registry).decode()  # no series yet: headers only
    _record(metrics)
    text = metrics.text()
    assert text == generate_latest(registry).decode()
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    [weird] = [s for s in parsed["gengate_requests"].samples if s.labels["code"] == "INVALID_ARGUMENT"]
    assert weird.labels["model"] == 'we"ird\\mo\ndel'
    _record(metrics)  # series seen before: their cached label text, new values
    assert metrics.text() == generate_latest(registry).decode()


def _steady(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("process_")]


def _get(url: str, **headers: str) -> tuple[bytes, dict[str, str]]:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.read(), dict(answer.headers)


def test_the_endpoint_answers_plain_text_itself_and_everything_else_through_prometheus_client() -> None:
    server = ServerMetrics()
    _record(server.metrics)
    server.serve("127.0.0.1", 0)
    try:
        url = f"http://{server.address}/metrics"
        plain, headers = _get(url)
        assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
        # the same families in the same order (the process's own move between two reads)
        assert _steady(plain.decode()) == _steady(generate_latest(server.registry).decode())
        assert "process_cpu_seconds_total" in plain.decode()
        zipped, headers = _get(url, **{"Accept-Encoding": "gzip"})
        assert headers["Content-Encoding"] == "gzip"
        assert _steady(gzip.decompress(zipped).decode()) == _steady(plain.decode())
        open_metrics, headers = _get(url, Accept="application/openmetrics-text; version=1.0.0")
        assert headers["Content-Type"].startswith("application/openmetrics-text")
        assert open_metrics.decode().endswith("# EOF\n")
        for name, family in (
            ("gengate_requests_total", "gengate_requests"),
            ("process_cpu_seconds_total", "process_cpu_seconds"),
        ):
            selected, _ = _get(f"{url}?name[]={name}")  # prometheus_client's selection, by name
            assert {f.name for f in text_string_to_metric_families(selected.decode())} == {family}
        options = urllib.request.Request(url, method="OPTIONS")
        with urllib.request.urlopen(options, timeout=10) as answer:  # prometheus_client's answer
            assert answer.headers["Allow"] == "OPTIONS,GET"
    finally:
        server.close()
