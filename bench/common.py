"""Shared helpers of the bench scripts: timed concurrent runs, percentiles, tables, a server subprocess.

Every benchmark compares two things measured in the same run and reports their ratio: absolute
times on a shared machine drift from run to run, ratios much less.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
# About 16 tokens of the tiny model's tokenizer (it was trained on this kind of English).
PROMPT = "Please write a short story about a robot who learns to paint in a quiet town."
# A JSON Schema the constrained benchmarks ask for (batching.py, mlx_engine.py).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "rating": {"type": "integer"},
        "summary": {"type": "string"},
    },
    "required": ["title", "tags", "rating", "summary"],
}
# A schema whose keys, enums and boolean are forced and whose values are short, as a trained
# model's outputs are: most of its tokens are forced (forced_share.py; constrained_step.py,
# batching.py and bench/run's constraints section run it beside SCHEMA).
EXTRACTION: dict[str, Any] = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "topics": {"type": "array", "items": {"enum": ["price", "quality", "delivery", "support"]}},
        "needs_follow_up": {"type": "boolean"},
    },
    "required": ["sentiment", "confidence", "topics", "needs_follow_up"],
    "additionalProperties": False,
}


@dataclass
class RunStats:
    """What one timed run of many requests measured."""

    name: str
    concurrency: int = 1
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0  # a watched process's CPU time during this variant's own runs (run_interleaved)

    @property
    def label(self) -> str:
        return f"{self.name} c={self.concurrency}"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s else 0.0

    def latency_ms(self, q: float) -> float:
        return 1000 * percentile(self.latencies_s, q)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def run_concurrent(
    name: str, call: Callable[[int], Awaitable[int]], requests: int, concurrency: int
) -> RunStats:
    """Runs `call(i)` for i in range(requests), at most `concurrency` at once.

    `call` returns the number of output tokens it produced; each call's latency is timed from
    when it starts (not when it was queued behind the concurrency limit).
    """
    stats = RunStats(name, concurrency)
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=requests, desc=stats.label, unit="req", leave=False, file=sys.stderr)

    async def one(i: int) -> None:
        async with limit:
            started = time.perf_counter()
            tokens = await call(i)  # not `stats.tokens += await ...`: that reads the total before awaiting
            stats.latencies_s.append(time.perf_counter() - started)
            stats.tokens += tokens
            bar.update()

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        bar.close()
    stats.wall_s = time.perf_counter() - started
    stats.requests = requests
    return stats


async def run_interleaved(
    variants: Sequence[tuple[str, Callable[[int], Awaitable[int]]]],
    requests: int,
    concurrency: int | Sequence[int],
    rounds: int,
    warmup: int = 3,
    cpu: Mapping[str, Callable[[], float]] | None = None,
) -> list[RunStats]:
    """Runs every variant `rounds` times, taking turns (A B C A B C ...), and sums each one's rounds.

    Taking turns spreads the machine's slow moments over all variants instead of one.
    `concurrency` is one for all variants, or one per variant. `cpu`: for a variant's name, the
    CPU seconds of the process serving it so far (e.g. `lambda: cpu_seconds(pid)`), read around
    each of its runs alone into `cpu_s` (warm-ups and the other variants' turns left out).
    """
    meters = cpu or {}
    limits = [concurrency] * len(variants) if isinstance(concurrency, int) else list(concurrency)
    for _, call in variants:
        for i in range(warmup):
            await call(1_000_000 + i)
    totals = [RunStats(name, limit) for (name, _), limit in zip(variants, limits, strict=True)]
    for _ in range(rounds):
        for total, (name, call) in zip(totals, variants, strict=True):
            meter = meters.get(name)
            before = meter() if meter else 0.0
            one = await run_concurrent(name, call, requests, total.concurrency)
            total.cpu_s += meter() - before if meter else 0.0
            total.requests += one.requests
            total.tokens += one.tokens
            total.wall_s += one.wall_s
            total.latencies_s += one.latencies_s
    return totals


def print_table(title: str, rows: Sequence[RunStats], *, tokens: bool = True) -> None:
    """One line per run: throughput and latency percentiles."""
    print(f"\n{title}")
    head = f"  {'run':<36} {'req':>5} {'req/s':>8}"
    if tokens:
        head += f" {'tokens':>7} {'tok/s':>8}"
    print(head + f" {'p50 ms':>8} {'p95 ms':>8}")
    for row in rows:
        line = f"  {row.label:<36} {row.requests:>5} {row.requests_per_s:>8.1f}"
        if tokens:
            line += f" {row.tokens:>7} {row.tokens_per_s:>8.1f}"
        print(line + f" {row.latency_ms(50):>8.2f} {row.latency_ms(95):>8.2f}")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def print_ratios(pairs: Sequence[tuple[RunStats, RunStats]], *, tokens: bool = True) -> list[str]:
    """Prints measured/peer ratios of throughput and p50 latency; returns short summary items."""
    unit = "tok/s" if tokens else "req/s"
    print(f"  ratios, measured / peer ({unit}; p50 latency):")
    summary = []
    for row, peer in pairs:
        speed = (
            ratio(row.tokens_per_s, peer.tokens_per_s)
            if tokens
            else ratio(row.requests_per_s, peer.requests_per_s)
        )
        latency = ratio(row.latency_ms(50), peer.latency_ms(50))
        name = f"{row.name} / {peer.name}"
        print(f"    {name:<52} c={row.concurrency:<3} {speed:5.2f}x {unit}  {latency:5.2f}x p50")
        summary.append(f"{row.name}/{peer.name}@c{row.concurrency} {speed:.2f}")
    return summary


# HOST:PORT -> pid of each server gengate_server started (cpu_seconds reads its CPU time).
SERVER_PIDS: dict[str, int] = {}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc): steadier than req/s when
    the variants are separate processes on a shared machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> float:
    """CPU time of a process's live threads, to the nanosecond (/proc/PID/task/*/schedstat): for
    short rounds, where cpu_seconds' 10 ms ticks are ±2% of a 0.5 s round. Threads that have
    ended count no more (e.g. a metrics scrape's, ~0.4 ms a scrape): over a whole run, use
    cpu_seconds."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, IndexError, ValueError):  # the thread ended while being read
            continue
    return total / 1e9


@contextlib.contextmanager
def gengate_server(
    models: list[dict[str, Any]],
    *,
    timeout_s: float = 120.0,
    server: dict[str, Any] | None = None,
    data_dir: str | None = None,
    callers: list[dict[str, Any]] | None = None,
    repo: Path | None = None,
) -> Iterator[str]:
    """Runs `gengate serve` on a free port in a subprocess with these model entries (and `server`
    settings, `callers`); yields HOST:PORT. Its job store lives in `data_dir` (default: a temp dir).
    `repo`: another checkout's server (an older commit, as a before/after peer), same Python.

    A separate process, as in production: the client's Python does not share the server's GIL.
    """
    with tempfile.TemporaryDirectory(prefix="gengate-bench-") as tmp:
        config = Path(tmp) / "config.yaml"
        document: dict[str, Any] = {"models": models}
        if server:
            document["server"] = server
        if callers:
            document["callers"] = callers
        config.write_text(yaml.safe_dump(document))
        log = open(Path(tmp) / "server.log", "w+")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GENGATE_DATA_DIR": data_dir or tmp}
        if repo is not None:
            env["PYTHONPATH"] = os.pathsep.join(str(repo / part) for part in ("server", "clients/python"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "gengate", "serve", "--config", str(config), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=repo or REPO,
        )
        try:
            address = _wait_serving(proc, log, timeout_s)
            SERVER_PIDS[address] = proc.pid
            yield address
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _wait_serving(proc: subprocess.Popen[str], log: Any, timeout_s: float) -> str:
    """Reads stdout until the server says where it serves; on a thread, so a silent hang times out."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line.startswith("gengate serving on "):
            return line.split()[3]
        if not line:
            break
    log.seek(0)
    raise RuntimeError(f"gengate serve did not start (exit {proc.poll()}):\n{log.read()[-3000:]}")


Call = Callable[[int], Awaitable[int]]  # one request numbered i; returns its output tokens
Pair = tuple[RunStats, RunStats]  # (measured, its peer)


def unary_calls(client: Any, model: str, prompt: str, max_tokens: int, made: list[int] | None = None) -> Call:
    """One unary generate per request on `model` (the overhead benches: its output is not counted);
    `made[0]` counts the calls, warm-ups included."""

    async def call(i: int) -> int:
        await client.generate(model, prompt, max_tokens=max_tokens)
        if made is not None:
            made[0] += 1
        return 0

    return call
