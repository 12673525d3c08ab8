"""Metrics read at scrape time from what the server's parts already count: routes (in flight,
queued), engine workers (serving, restarts, GPU memory), the constraint sandbox, the job runner.

A scrape runs on the metrics endpoint's thread: it only reads plain counters and sizes the
event loop updates (a value one update old is fine for a gauge), and asks NVML, which is
thread-safe, for the placed GPUs' memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gengate.jobs.runner import JobRunner
from gengate.router import Router, Slots
from gengate.service import GenerationCore
from gengate.workers.backend import WorkerBackend
from gengate.workers.placement import GpuInfo

log = logging.getLogger(__name__)


@dataclass
class ServerParts:
    """What a scrape reads; set once the server has built them (None before)."""

    router: Router | None = None
    core: GenerationCore | None = None
    runner: JobRunner | None = None


@dataclass(frozen=True)
class Family:
    """A family read at scrape time: name (counters without `_total`), type, help, labels."""

    name: str
    kind: str  # counter | gauge
    help: str
    labels: tuple[str, ...] = ()

    def new(self) -> CounterMetricFamily | GaugeMetricFamily:
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.help, labels=self.labels)
        return GaugeMetricFamily(self.name, self.help, labels=self.labels)


MODEL_INFO = Family("gengate_model_info", "gauge", "Served models (value 1).", ("model", "backend"))
MAX_CONCURRENCY = Family(
    "gengate_model_max_concurrency", "gauge", "Calls a model runs at once (max_concurrency).", ("model",)
)
IN_FLIGHT = Family(
    "gengate_in_flight_requests",
    "gauge",
    "Calls holding a model's concurrency slot now: interactive calls, and background ones (batch-job items).",
    ("model", "priority"),
)
QUEUED = Family(
    "gengate_queued_requests",
    "gauge",
    "Calls waiting for a model's concurrency slot now (interactive ones are bounded by max_queue).",
    ("model", "priority"),
)
SERVING = Family(
    "gengate_model_serving", "gauge", "1 while a model serves, 0 while its worker is down.", ("model",)
)
RESTARTS = Family(
    "gengate_worker_restarts",
    "counter",
    "Engine worker processes restarted after they died (crash, kill -9, OOM).",
    ("model",),
)
GPU_USED = Family(
    "gengate_gpu_memory_used_bytes",
    "gauge",
    "Memory in use on each GPU placed for a model (NVML; the whole device, every process).",
    ("model", "gpu"),
)
GPU_TOTAL = Family(
    "gengate_gpu_memory_total_bytes",
    "gauge",
    "Memory of each GPU placed for a model (NVML).",
    ("model", "gpu"),
)
CHECKS = Family(
    "gengate_constraint_checks",
    "counter",
    "Constraint checks of the server's sandbox (syntax, lowering, trial compile): checked in a sandbox "
    "process, or answered by a remembered verdict (cached).",
    ("result",),
)
CHECKER_KILLS = Family(
    "gengate_constraint_checker_kills",
    "counter",
    "Sandbox processes ended by a check (over its time budget, out of memory, crashed).",
)
JOB_ITEMS = Family(
    "gengate_batch_job_items", "counter", "Batch-job item results this server stored, by state.", ("state",)
)
JOB_ITEMS_NOW = Family(
    "gengate_batch_job_items_current",
    "gauge",
    "Batch-job items now: running on this server, and unfinished in the store's queued and running jobs "
    "(every replica's, as of the runner's last read).",
    ("state",),
)
SCRAPED = (
    MODEL_INFO, MAX_CONCURRENCY, IN_FLIGHT, QUEUED, SERVING, RESTARTS, GPU_USED, GPU_TOTAL, CHECKS,
    CHECKER_KILLS, JOB_ITEMS, JOB_ITEMS_NOW,
)  # fmt: skip


class ServerCollector:
    """A prometheus_client collector over a server's parts (registered in its registry)."""

    def __init__(self) -> None:
        self.parts = ServerParts()

    def describe(self) -> list[Metric]:
        """The families, empty: the names a scrape's `name[]` selection finds this collector by."""
        return [spec.new() for spec in SCRAPED]

    def collect(self) -> Iterator[Metric]:
        parts = self.parts
        if parts.router is not None:
            yield from self._routes(parts.router)
        if parts.core is not None:
            sandbox = parts.core.sandbox
            checks = CHECKS.new()
            checks.add_metric(["checked"], sandbox.checks_run)
            checks.add_metric(["cached"], sandbox.cache_hits)
            kills = CHECKER_KILLS.new()
            kills.add_metric([], sandbox.killed)
            yield from (checks, kills)
        if parts.runner is not None:
            runner = parts.runner
            stored = JOB_ITEMS.new()
            stored.add_metric(["succeeded"], runner.finished_items - runner.failed_items)
            stored.add_metric(["failed"], runner.failed_items)
            now = JOB_ITEMS_NOW.new()
            now.add_metric(["running"], runner.in_flight)
            now.add_metric(["unfinished"], runner.unfinished_items)
            yield from (stored, now)

    def _routes(self, router: Router) -> Iterator[Metric]:
        info, limit, in_flight, queued = (
            MODEL_INFO.new(),
            MAX_CONCURRENCY.new(),
            IN_FLIGHT.new(),
            QUEUED.new(),
        )
        serving, restarts, gpu_used, gpu_total = (
            SERVING.new(),
            RESTARTS.new(),
            GPU_USED.new(),
            GPU_TOTAL.new(),
        )
        for route in router.routes:
            name = route.name
            info.add_metric([name, route.config.backend], 1)
            limit.add_metric([name], route.config.max_concurrency)
            slots = route.slots
            if isinstance(slots, Slots):
                in_flight.add_metric([name, "interactive"], slots.interactive_active)
                in_flight.add_metric([name, "background"], slots.background_active)
            else:
                in_flight.add_metric([name, "interactive"], route.in_flight)
                in_flight.add_metric([name, "background"], 0)
            queued.add_metric([name, "interactive"], route.waiting)
            queued.add_metric([name, "background"], route.background_waiting)
            backend = route.backend
            if isinstance(backend, WorkerBackend):
                serving.add_metric([name], int(backend.serving))
                restarts.add_metric([name], backend.restarts)
                for gpu in placed_gpus(backend):
                    gpu_used.add_metric([name, str(gpu.index)], gpu.memory_total - gpu.memory_free)
                    gpu_total.add_metric([name, str(gpu.index)], gpu.memory_total)
            else:
                serving.add_metric([name], int(route.started))
        yield from (info, limit, in_flight, queued, serving, restarts, gpu_used, gpu_total)


def placed_gpus(backend: WorkerBackend) -> list[GpuInfo]:
    """The GPUs placed for a worker as its device provider (NVML) sees them now; none without a
    placement, a provider, or a working NVML (no GPU here: the families stay empty)."""
    lease, provider = backend.lease, backend.device_provider
    if lease is None or provider is None:
        return []
    try:
        devices = provider.list_devices()
    except Exception:  # a scrape never fails because NVML did
        log.debug("listing GPUs for metrics failed", exc_info=True)
        return []
    return [d for d in devices if d.index in lease.devices]
