"""A server's metrics: Prometheus text on an HTTP port of its own, and OTLP export when configured.

Each server has its own registry (several servers may run in one process: tests do), holding
the families recorded as calls end (`families.Metrics`, the server's observer), those read at
scrape time from the server's parts (`scrape.ServerCollector`) and the process's own. This
package is the only place that imports prometheus_client; the rest of the server sees the
observer interfaces of gengate.observation.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector

from gengate.config import MetricsSettings, ModelPrice
from gengate.jobs.runner import JobRunner
from gengate.metrics.endpoint import metrics_app, serve_http
from gengate.metrics.families import Metrics
from gengate.metrics.otlp import OtlpMetricsBridge, otlp_bridge
from gengate.metrics.scrape import SCRAPED, ServerCollector
from gengate.router import Router
from gengate.service import GenerationCore

__all__ = ["Metrics", "ServerMetrics", "catalogue", "start_metrics"]

log = logging.getLogger("gengate")


class ServerMetrics:
    """One server's metrics and where they go: the endpoint (if a port is set), OTLP (if set up)."""

    def __init__(self, prices: Mapping[str, ModelPrice] | None = None) -> None:
        # auto_describe: the process collector, which has no describe(), is found by name too
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = Metrics(self.registry, prices)
        self.collector = ServerCollector()
        process = ProcessCollector(registry=None)
        # The scrape-time collectors in a registry of their own too, for a scrape that writes
        # `metrics` itself (endpoint.py).
        self._scraped = CollectorRegistry(auto_describe=True)
        for registry in (self.registry, self._scraped):
            registry.register(self.collector)
            registry.register(process)
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.otlp: OtlpMetricsBridge | None = None
        self.host: str | None = None
        self.port: int | None = None

    def attach(self, router: Router, core: GenerationCore, runner: JobRunner) -> None:
        """What scrapes read from now on."""
        parts = self.collector.parts
        parts.router, parts.core, parts.runner = router, core, runner

    def serve(self, host: str, port: int) -> None:
        """Starts the HTTP endpoint (a daemon thread); OSError when the port cannot be bound."""
        app = metrics_app(self.registry, self.metrics.text, self._scraped)
        self._httpd, self._thread = serve_http(app, host, port)
        self.host, self.port = host, int(self._httpd.server_port)

    @property
    def address(self) -> str | None:
        if self.port is None or self.host is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def close(self) -> None:
        """Stops the endpoint and exports what OTLP has not sent yet."""
        if self.otlp is not None:
            self.otlp.close()
            self.otlp = None
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def start_metrics(
    settings: MetricsSettings, server_host: str, env: Mapping[str, str] | None = None
) -> ServerMetrics | None:
    """The server's metrics when any is asked for: `server.metrics.port` (the endpoint, bound now,
    so a port in use fails the start before any model loads) and/or OTLP export
    (OTEL_EXPORTER_OTLP_ENDPOINT with the `otel` extra installed). None: metrics are off."""
    metrics = ServerMetrics(settings.prices)
    metrics.otlp = otlp_bridge(metrics.registry, env)
    if settings.port is None and metrics.otlp is None:
        return None
    if settings.port is not None:
        host = settings.host or server_host
        try:
            metrics.serve(host, settings.port)
        except OSError as exc:
            metrics.close()
            raise OSError(f"cannot serve metrics on {host}:{settings.port}: {exc.strerror or exc}") from exc
        log.info("metrics: Prometheus text on http://%s/metrics", metrics.address)
    return metrics


# The process collector's families a dashboard uses (prometheus_client's own, unlabelled).
PROCESS_FAMILIES = {
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_open_fds": "gauge",
    "process_start_time_seconds": "gauge",
}


def catalogue() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every family a server exports: name (counters without `_total`) -> (type, label names).
    What the README, the dashboard and the alerts are checked against."""
    found: dict[str, tuple[str, tuple[str, ...]]] = {f.name: (f.kind, f.labels) for f in Metrics().families}
    for spec in SCRAPED:
        found[spec.name] = (spec.kind, spec.labels)
    for name, kind in PROCESS_FAMILIES.items():
        found[name] = (kind, ())
    return found
