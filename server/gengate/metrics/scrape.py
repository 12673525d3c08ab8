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


class ServerCollector:
    """A prometheus_client collector over a server's parts (registered in its registry)."""

    def __init__(self) -> None:
        self.parts = ServerParts()

    def describe(self) -> list[Metric]:
        return []  # names are not checked against other collectors: they are gengate's own

    def collect(self) -> Iterator[Metric]:
        parts = self.parts
        if parts.router is not None:
            yield from self._routes(parts.router)
        if parts.core is not None:
            sandbox = parts.core.sandbox
            checks = CounterMetricFamily(
                "gengate_constraint_checks",
                "Constraint checks of the server's sandbox (syntax, lowering, trial compile): "
                "checked in a sandbox process, or answered by a remembered verdict (cached).",
                labels=["result"],
            )
            checks.add_metric(["checked"], sandbox.checks_run)
            checks.add_metric(["cached"], sandbox.cache_hits)
            yield checks
            yield CounterMetricFamily(
                "gengate_constraint_checker_kills",
                "Sandbox processes ended by a check (over its time budget, out of memory, crashed).",
                value=sandbox.killed,
            )
        if parts.runner is not None:
            runner = parts.runner
            stored = CounterMetricFamily(
                "gengate_batch_job_items",
                "Batch-job item results this server stored, by state.",
                labels=["state"],
            )
            stored.add_metric(["succeeded"], runner.finished_items - runner.failed_items)
            stored.add_metric(["failed"], runner.failed_items)
            yield stored
            now = GaugeMetricFamily(
                "gengate_batch_job_items_current",
                "Batch-job items now: running on this server, and unfinished in the store's queued "
                "and running jobs (every replica's, as of the runner's last read).",
                labels=["state"],
            )
            now.add_metric(["running"], runner.in_flight)
            now.add_metric(["unfinished"], runner.unfinished_items)
            yield now

    def _routes(self, router: Router) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "gengate_model_info", "Served models (value 1).", labels=["model", "backend"]
        )
        limit = GaugeMetricFamily(
            "gengate_model_max_concurrency", "Calls a model runs at once (max_concurrency).", labels=["model"]
        )
        in_flight = GaugeMetricFamily(
            "gengate_in_flight_requests",
            "Calls holding a model's concurrency slot now: interactive calls, and background ones "
            "(batch-job items).",
            labels=["model", "priority"],
        )
        queued = GaugeMetricFamily(
            "gengate_queued_requests",
            "Calls waiting for a model's concurrency slot now (interactive ones are bounded by max_queue).",
            labels=["model", "priority"],
        )
        serving = GaugeMetricFamily(
            "gengate_model_serving", "1 while a model serves, 0 while its worker is down.", labels=["model"]
        )
        restarts = CounterMetricFamily(
            "gengate_worker_restarts",
            "Engine worker processes restarted after they died (crash, kill -9, OOM).",
            labels=["model"],
        )
        gpu_used = GaugeMetricFamily(
            "gengate_gpu_memory_used_bytes",
            "Memory in use on each GPU placed for a model (NVML; the whole device, every process).",
            labels=["model", "gpu"],
        )
        gpu_total = GaugeMetricFamily(
            "gengate_gpu_memory_total_bytes",
            "Memory of each GPU placed for a model (NVML).",
            labels=["model", "gpu"],
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
