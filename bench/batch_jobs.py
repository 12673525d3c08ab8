"""Durable batch jobs against their peers, measured in one run (ratios; these machines are noisy):

(a) throughput: N items on the tiny llama.cpp model as one BatchJobService job (uploaded, results
    followed) vs the same items through one BatchGenerate stream — job items/s ÷ batch items/s;
(b) interactive latency: p50 of single Generate calls on the same model while a job runs vs idle;
(c) resume: a `gengate serve` killed with -9 mid-job, restarted on the same store: seconds from
    the new server serving to the job's next finished item, and the job ends with one result
    per item.

    .venv/bin/python bench/batch_jobs.py [--items 10000] [--quick]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from common import REPO, gengate_server
from gengate_client import Client

MODEL: dict[str, Any] = {"name": "tiny", "backend": "llamacpp", "tiny": True}
SERVER: dict[str, Any] = {"max_batch_items": 100_000, "jobs": {"concurrency": 16, "poll_s": 0.2}}
MAX_TOKENS = 8


def _items(count: int) -> list[dict[str, Any]]:
    return [
        {"model": "tiny", "prompt": f"Item {i}:", "max_tokens": MAX_TOKENS, "seed": i} for i in range(count)
    ]


def throughput(address: str, count: int) -> tuple[float, float]:
    """(job items/s, BatchGenerate items/s) for the same `count` items."""
    with Client(address, timeout=3600) as client:
        items = _items(count)
        began = time.perf_counter()
        done = sum(1 for _ in client.batch_generate_iter(items))
        batch_s = time.perf_counter() - began
        assert done == count
        began = time.perf_counter()
        job = client.batch_jobs.create(items)
        results = sum(1 for _ in client.batch_jobs.results(job.id))
        job_s = time.perf_counter() - began
        assert results == count
    return count / job_s, count / batch_s


def interactive_latency(address: str, calls: int) -> tuple[float, float]:
    """(p50 ms idle, p50 ms while a job runs on the same model)."""
    with Client(address, timeout=600) as client:

        def p50() -> float:
            took = []
            for i in range(calls):
                began = time.perf_counter()
                client.generate("tiny", f"Question {i}:", max_tokens=MAX_TOKENS, seed=i)
                took.append(time.perf_counter() - began)
            return 1000 * statistics.median(took)

        idle = p50()
        job = client.batch_jobs.create(_items(calls * 200))
        while client.batch_jobs.get(job.id).state != "running":
            time.sleep(0.05)
        busy = p50()
        client.batch_jobs.cancel(job.id)
    return idle, busy


def _serve(config: Path, data_dir: str) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GENGATE_DATA_DIR": data_dir}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gengate", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if "serving on" in line:
            return proc, line.split("serving on ")[1].split()[0]
    raise RuntimeError("the server did not start")


def resume(count: int) -> tuple[float, int, int]:
    """(seconds from the restarted server serving to the next finished item, done, total)."""
    with tempfile.TemporaryDirectory(prefix="gengate-bench-jobs-") as data_dir:
        config = Path(data_dir) / "config.yaml"
        config.write_text(yaml.safe_dump({"models": [MODEL], "server": SERVER}))
        proc, address = _serve(config, data_dir)
        with Client(address, timeout=600) as client:
            job = client.batch_jobs.create(_items(count))
            while client.batch_jobs.get(job.id).done < count // 10:
                time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc, address = _serve(config, data_dir)
        serving = time.perf_counter()
        try:
            with Client(address, timeout=600) as client:
                before = client.batch_jobs.get(job.id).done
                while client.batch_jobs.get(job.id).done == before:
                    time.sleep(0.01)
                resumed_s = time.perf_counter() - serving
                finished = sum(1 for _ in client.batch_jobs.results(job.id))
                final = client.batch_jobs.get(job.id)
        finally:
            proc.terminate()
            proc.wait()
    assert finished == count and final.done == final.total == count
    return resumed_s, final.done, final.total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=30, help="interactive calls per latency sample")
    parser.add_argument("--quick", action="store_true", help="1,000 items, 10 calls")
    args = parser.parse_args()
    items, calls = (1000, 10) if args.quick else (args.items, args.calls)
    with gengate_server([MODEL], server=SERVER) as address:
        job_rate, batch_rate = throughput(address, items)
        idle, busy = interactive_latency(address, calls)
    resumed_s, done, total = resume(max(200, items // 10))
    print(f"throughput, {items} items, max_tokens {MAX_TOKENS}, tiny llama.cpp:")
    print(f"  BatchJobService job  {job_rate:8.1f} items/s")
    print(f"  BatchGenerate        {batch_rate:8.1f} items/s")
    print(f"  ratio job / BatchGenerate: {job_rate / batch_rate:.2f}")
    print(
        f"interactive Generate p50: idle {idle:.1f} ms, under a running job {busy:.1f} ms, "
        f"ratio {busy / idle:.2f}"
    )
    print(
        f"resume after kill -9: next item {resumed_s:.2f} s after the new server serves; {done}/{total} done"
    )


if __name__ == "__main__":
    main()
