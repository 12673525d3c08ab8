"""OTLP export of a server's metrics: the same registry the Prometheus endpoint serves, read every
OTEL_METRIC_EXPORT_INTERVAL and sent to OTEL_EXPORTER_OTLP_(METRICS_)ENDPOINT, so the two never
disagree (one set of counters, two ways out).

Prometheus families become OTLP metrics with cumulative temporality: counters monotonic sums,
gauges gauges, histograms explicit-bucket histograms (the bucket counts of Prometheus' cumulative
buckets). The GenAI families take their semantic-convention names and attribute keys
(`gen_ai_server_request_duration_seconds{gen_ai_request_model}` is
`gen_ai.server.request.duration` in `s` with `gen_ai.request.model`); gengate's own keep their
names without the unit suffix, which an OTLP-to-Prometheus exporter adds back. Needs the `otel`
extra (opentelemetry-exporter-otlp); without it the endpoint variable only logs a warning.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric as PromMetric

from gengate.metrics.families import SEMCONV_LABELS, SEMCONV_NAMES

log = logging.getLogger("gengate")

DEFAULT_INTERVAL_S = 60.0
_UNITS = {"seconds": "s", "bytes": "By", "tokens": "{token}"}


def _enabled(env: Mapping[str, str]) -> bool:
    endpoint = env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return env.get("OTEL_METRICS_EXPORTER", "otlp").strip().lower() != "none"


def _exporter(env: Mapping[str, str]) -> Any:
    """The OTLP metric exporter the OTEL_EXPORTER_OTLP_* variables ask for (they configure it)."""
    protocol = env.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

        return Http()
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

    return Grpc()


def otlp_bridge(
    registry: CollectorRegistry, env: Mapping[str, str] | None = None
) -> OtlpMetricsBridge | None:
    """A started bridge from `registry` to OTLP when the environment asks for one, else None."""
    env = os.environ if env is None else env
    if not _enabled(env):
        return None
    try:
        exporter = _exporter(env)
    except ImportError:
        log.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp is not installed "
            "(pip install 'gengate[otel]'): metrics are not exported over OTLP"
        )
        return None
    try:
        interval_s = float(env.get("OTEL_METRIC_EXPORT_INTERVAL", "")) / 1000
    except ValueError:
        interval_s = DEFAULT_INTERVAL_S
    bridge = OtlpMetricsBridge(registry, exporter, interval_s if interval_s > 0 else DEFAULT_INTERVAL_S)
    bridge.start()
    log.info("metrics: exported over OTLP every %g s", bridge.interval_s)
    return bridge


class OtlpMetricsBridge:
    """Reads a registry and exports it over OTLP, every `interval_s` (a daemon thread) and at close."""

    def __init__(self, registry: CollectorRegistry, exporter: Any, interval_s: float) -> None:
        self.registry = registry
        self.exporter = exporter
        self.interval_s = interval_s
        self.started_ns = time.time_ns()
        self.exports = 0  # exports the exporter took (for tests and logs)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one export at a time (the thread's and close's)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gengate-otlp-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.export()

    def export(self) -> bool:
        """Sends the registry's values now; False when the exporter failed (it logged why)."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        with self._lock:
            try:
                data = metrics_data(self.registry.collect(), self.started_ns, time.time_ns())
                ok = self.exporter.export(data, timeout_millis=10_000) is MetricExportResult.SUCCESS
            except Exception:
                log.warning("metrics: the OTLP export failed", exc_info=True)
                return False
            self.exports += int(ok)
            return ok

    def close(self) -> None:
        """Stops the thread, exports one last time and shuts the exporter down."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 15)
            self._thread = None
        self.export()
        try:
            self.exporter.shutdown()
        except Exception:
            log.debug("metrics: shutting the OTLP exporter down failed", exc_info=True)


def otel_name(family: PromMetric) -> tuple[str, str]:
    """The OTLP name and unit of a Prometheus family."""
    name = family.name
    if name in SEMCONV_NAMES:
        unit = "{token}" if name.endswith("_tokens") else "s"
        return SEMCONV_NAMES[name], unit
    for suffix, unit in _UNITS.items():
        if name.endswith("_" + suffix):
            return name[: -len(suffix) - 1], unit
    return name, "1" if family.type == "counter" else ""


def _attributes(labels: Mapping[str, str], semconv: bool) -> dict[str, str]:
    if not semconv:
        return dict(labels)
    return {SEMCONV_LABELS.get(k, k): v for k, v in labels.items()}


def _key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def metrics_data(families: Iterable[PromMetric], started_ns: int, now_ns: int) -> Any:
    """Prometheus families as an OTLP MetricsData (cumulative, from `started_ns` or each series'
    own `_created` time)."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Histogram,
        HistogramDataPoint,
        Metric,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    cumulative = AggregationTemporality.CUMULATIVE
    metrics: list[Any] = []
    for family in families:
        name, unit = otel_name(family)
        semconv = family.name in SEMCONV_NAMES
        created = {
            _key(s.labels): int(s.value * 1e9) for s in family.samples if s.name == family.name + "_created"
        }
        data: Any = None
        if family.type in ("counter", "gauge"):
            value_name = family.name + "_total" if family.type == "counter" else family.name
            points = [
                NumberDataPoint(
                    attributes=_attributes(s.labels, semconv),
                    start_time_unix_nano=created.get(_key(s.labels), started_ns),
                    time_unix_nano=now_ns,
                    value=s.value,
                )
                for s in family.samples
                if s.name == value_name
            ]
            if family.type == "counter":
                data = Sum(data_points=points, aggregation_temporality=cumulative, is_monotonic=True)
            else:
                data = Gauge(data_points=points)
        elif family.type == "histogram":
            data = Histogram(
                data_points=_histogram_points(
                    family, semconv, created, started_ns, now_ns, HistogramDataPoint
                ),
                aggregation_temporality=cumulative,
            )
        if data is not None and data.data_points:
            metrics.append(Metric(name=name, description=family.documentation, unit=unit, data=data))
    resource_attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "gengate"}
    scope = InstrumentationScope("gengate")
    return MetricsData(
        resource_metrics=[
            ResourceMetrics(
                resource=Resource.create(resource_attrs),
                scope_metrics=[ScopeMetrics(scope=scope, metrics=metrics, schema_url="")],
                schema_url="",
            )
        ]
    )


def _histogram_points(
    family: PromMetric,
    semconv: bool,
    created: Mapping[tuple[tuple[str, str], ...], int],
    started_ns: int,
    now_ns: int,
    point: Any,
) -> list[Any]:
    """One OTLP point per label set: bounds without +Inf, per-bucket counts from cumulative ones."""
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        entry = series.setdefault(_key(labels), {"labels": labels, "buckets": [], "count": 0, "sum": 0.0})
        if s.name == family.name + "_bucket":
            entry["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name == family.name + "_count":
            entry["count"] = int(s.value)
        elif s.name == family.name + "_sum":
            entry["sum"] = s.value
    points = []
    for key, entry in series.items():
        buckets = sorted(entry["buckets"])
        counts, previous = [], 0.0
        for _, cumulative in buckets:
            counts.append(int(cumulative - previous))
            previous = cumulative
        points.append(
            point(
                attributes=_attributes(entry["labels"], semconv),
                start_time_unix_nano=created.get(key, started_ns),
                time_unix_nano=now_ns,
                count=entry["count"],
                sum=entry["sum"],
                bucket_counts=counts,
                explicit_bounds=[bound for bound, _ in buckets if bound != float("inf")],
                min=None,  # Prometheus histograms keep neither: left unset in OTLP
                max=None,
            )
        )
    return points
