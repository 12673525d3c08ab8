"""What metrics cost per call: the model-free `scripted` echo model through two `gengate serve`
processes, one with metrics on (`--metrics-port`, scraped once a second meanwhile, as a
Prometheus would but more often) and one without, interleaved.

The scripted model does no work, so the ratio is the whole per-call cost of observing a request
and a routed call and recording its series, over the server's fixed per-call cost (~1 ms);
on a real model, where a call takes milliseconds to seconds, it is a fraction of that. On a
shared machine that ratio is within the run-to-run noise, so the script also measures the
service core in this process (GenerationCore.generate on the scripted model, no gRPC), with and
without the observer, in CPU time, best of many interleaved rounds: the microseconds a call costs.

    .venv/bin/python bench/metrics_overhead.py [--quick] [--requests 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

from common import RunStats, gengate_server, print_ratios, print_table, run_interleaved, unary_calls

MAX_TOKENS = 8
PROMPT = "hello metrics world"
MODELS: list[dict[str, Any]] = [{"name": "echo", "backend": "scripted"}]


def stream(client: Any) -> Callable[[int], Awaitable[int]]:
    async def call(i: int) -> int:
        return sum([1 async for _ in client.generate_stream("echo", PROMPT, max_tokens=MAX_TOKENS)])

    return call


def scraper(url: str, stop: threading.Event) -> threading.Thread:
    """Scrapes `url` every second until `stop` is set (the metrics server's own thread serves it)."""

    def run() -> None:
        while not stop.wait(1.0):
            with urllib.request.urlopen(url, timeout=10) as response:
                response.read()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def run(requests: int, rounds: int) -> None:
    from gengate_client import AsyncClient

    port = free_port()
    on_server = {"metrics": {"port": port, "host": "127.0.0.1"}}
    url = f"http://127.0.0.1:{port}/metrics"
    with gengate_server(MODELS) as off_address, gengate_server(MODELS, server=on_server) as on_address:
        stop = threading.Event()
        thread = scraper(url, stop)
        try:
            async with AsyncClient(off_address) as off, AsyncClient(on_address) as on:
                rows: list[RunStats] = []
                pairs: list[tuple[RunStats, RunStats]] = []
                for conc in (1, 8):
                    variants = [
                        ("metrics off unary", unary_calls(off, "echo", PROMPT, MAX_TOKENS)),
                        ("metrics on unary", unary_calls(on, "echo", PROMPT, MAX_TOKENS)),
                    ]
                    base, measured = await run_interleaved(variants, requests, conc, rounds)
                    rows += [base, measured]
                    pairs.append((measured, base))
                variants = [("metrics off stream", stream(off)), ("metrics on stream", stream(on))]
                base, measured = await run_interleaved(variants, requests, 1, rounds)
                rows += [base, measured]
                pairs.append((measured, base))
        finally:
            stop.set()
            thread.join()
        text = await asyncio.to_thread(_read, url)
    calls = sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("gengate_requests_total{")
    )
    print_table(
        f"scripted echo, max_tokens {MAX_TOKENS}, {requests * rounds} requests per run", rows, tokens=False
    )
    summary = print_ratios(pairs, tokens=False)
    print(f"  the metrics server counted {calls:.0f} requests (every call of its runs and warm-ups)")
    print(f"\nSUMMARY metrics on / off, req/s, 1.00 = no cost: {', '.join(summary)}")


def _read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
    return text


def free_port() -> int:
    """A port free a moment ago (gengate_server yields only the gRPC address, so the metrics port
    is chosen here rather than read back)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def core_cost(rounds: int, calls: int) -> tuple[float, float]:
    """CPU µs per GenerationCore.generate on the scripted model, observer off and on (best round)."""
    from gengate.config import parse_config
    from gengate.domain import GenerationRequest, StoppingCriteria
    from gengate.metrics import ServerMetrics
    from gengate.router import Router
    from gengate.service import GenerationCore

    config = parse_config({"models": MODELS})
    metrics = ServerMetrics()
    cores = []
    for observer in (None, metrics.metrics):
        router = Router.from_config(config, observer=observer)
        await router.start_all()
        cores.append(GenerationCore(router, observer=observer))
    request = GenerationRequest(model="echo", prompt=PROMPT, stopping=StoppingCriteria(max_tokens=MAX_TOKENS))
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, core in enumerate(cores):
            began = time.process_time()
            for _ in range(calls):
                await core.generate(request)
            best[i] = min(best[i], (time.process_time() - began) / calls * 1e6)
    for core in cores:
        await core.aclose()
        await core.router.close_all()
    return best[0], best[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--requests", type=int, default=None, help="requests per round (1000)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per variant (3)")
    args = parser.parse_args(argv)
    requests = args.requests or (200 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 3)
    asyncio.run(run(requests, rounds))
    off, on = asyncio.run(core_cost(10 if args.quick else 40, 1000))
    print(f"\nservice core in-process, CPU per call (best round): off {off:.1f} µs, on {on:.1f} µs")
    print(f"SUMMARY core CPU per call, metrics on - off: {on - off:.1f} µs ({on / off:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
