"""Priority under load (issue 13): a high-priority caller's p50 latency while a low-priority caller
keeps the model saturated, against the same high-priority calls on the idle model — the ratio
the README promises stays within 1.5x.

One `gengate serve` with a scripted model that serves 2 calls at a time (`max_concurrency: 2`,
`latency_s` per call) and two callers: `batch` (priority 0) keeps 16 calls in flight the whole
time (the queue always holds about 14 of them); `interactive` (priority 10) sends one call at a
time, after a pause of up to one call's latency. Without priorities each interactive call would
wait behind the queue (about 8 x latency); with them it waits for one slot to free (at most
1 x latency, half on average).

    .venv/bin/python bench/priority.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

from common import gengate_server

LATENCY_S = 0.05
MODELS: list[dict[str, Any]] = [
    {"name": "m", "backend": "scripted", "text": "ok", "latency_s": LATENCY_S, "max_concurrency": 2}
]
CALLERS = [
    {"name": "interactive", "token_env": "GENGATE_BENCH_HIGH", "priority": 10},
    {"name": "batch", "token_env": "GENGATE_BENCH_LOW", "priority": 0},
]
TOKENS = {"GENGATE_BENCH_HIGH": "bench-high-7d1e9a", "GENGATE_BENCH_LOW": "bench-low-2b8c4f"}


async def p50_of(client: Any, calls: int) -> float:
    """p50 of `calls` sequential calls, each after a seeded pause of up to one call's latency:
    an interactive caller's next call arrives at any point of the model's cycle (back to back,
    it would arrive just after its own slot went to the queue, and wait a whole call)."""
    rng = random.Random(7)
    latencies = []
    for _ in range(calls):
        await asyncio.sleep(rng.uniform(0, LATENCY_S))
        started = time.perf_counter()
        await client.generate("m", "x", max_tokens=1)
        latencies.append(time.perf_counter() - started)
    return statistics.median(latencies)


async def run(calls: int) -> None:
    from gengate_client import AsyncClient

    os.environ.update(TOKENS)
    with gengate_server(MODELS, callers=CALLERS) as address:
        high_meta = (("authorization", f"Bearer {TOKENS['GENGATE_BENCH_HIGH']}"),)
        low_meta = (("authorization", f"Bearer {TOKENS['GENGATE_BENCH_LOW']}"),)
        async with (
            AsyncClient(address, metadata=high_meta) as high,
            AsyncClient(address, metadata=low_meta) as low,
        ):
            await p50_of(high, 3)  # warm up
            idle = await p50_of(high, calls)
            stop = asyncio.Event()

            async def saturate() -> None:
                while not stop.is_set():
                    await low.generate("m", "x", max_tokens=1)

            load = [asyncio.create_task(saturate()) for _ in range(16)]
            await asyncio.sleep(0.5)  # the queue fills
            loaded = await p50_of(high, calls)
            stop.set()
            await asyncio.gather(*load)
    print(f"scripted model, {LATENCY_S * 1000:.0f} ms a call, 2 at a time; 16 low-priority calls in flight")
    print(f"  high-priority p50 idle   {idle * 1000:7.1f} ms")
    print(f"  high-priority p50 loaded {loaded * 1000:7.1f} ms")
    print(f"\nSUMMARY high-priority p50 loaded / idle: {loaded / idle:.2f}x (promise: <= 1.5x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="20 calls each (a smoke run)")
    args = parser.parse_args(argv)
    asyncio.run(run(20 if args.quick else 100))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
