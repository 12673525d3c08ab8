"""What operating gengate for many callers costs per call, all of it at once: the same unary calls
on the model-free `scripted` echo through three `gengate serve` processes, taken in turns —
bare (no callers, no metrics); callers with every quota (requests and tokens per minute,
max_concurrency, priority; set high enough never to refuse) plus metrics on their own port,
scraped every second; and the same with the quotas' state in a real Redis (`server.state`), as a
fleet of replicas runs them.

Ratios are req/s of each ÷ bare (1.00 = free), and each server process's CPU time per call
(/proc; Redis's own CPU added for the Redis variant), which moves far less between sittings than
req/s of separate processes: over the whole run, and as the median of paired rounds (each round
runs the three one after the other, every other round in reverse order; the median round is the
estimate, so a burst of other work on the machine spoils a few rounds, not the result). The
scripted model does no work, so this is the whole per-call cost over the server's fixed
per-call cost (~1 ms); on a real model it is a fraction of that. Redis is the Debian
`redis-server` (started in a temp dir, as the tests do).

    .venv/bin/python bench/operations_overhead.py [--quick] [--requests 1000] [--rounds 3]
        [--cpu-rounds 21] [--processes 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import Any

from callers import LIMITED, MODELS, TOKEN, TOKEN_VARIABLE
from common import (
    SERVER_PIDS,
    RunStats,
    cpu_seconds,
    gengate_server,
    print_ratios,
    print_table,
    run_concurrent,
    run_interleaved,
    thread_cpu_seconds,
    unary_calls,
)
from metrics_overhead import free_port, scraper

TESTS = Path(__file__).resolve().parent.parent / "tests"


@contextlib.contextmanager
def redis_url() -> Any:
    """A real redis-server for the run (tests/callers/redis_server.py), stopped after: its URL
    and pid."""
    sys.path[:0] = [str(TESTS), str(TESTS / "callers")]
    from redis_server import RedisServer

    server = RedisServer()
    server.start()
    try:
        assert server.proc is not None
        yield server.url, server.proc.pid
    finally:
        server.close()


async def run(requests: int, rounds: int, cpu_rounds: int, cpu_requests: int) -> None:
    from gengate_client import AsyncClient

    os.environ[TOKEN_VARIABLE] = TOKEN
    auth = (("authorization", f"Bearer {TOKEN}"),)
    ports = free_port(), free_port()
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        state, redis_pid = stack.enter_context(redis_url())
        bare = stack.enter_context(gengate_server(MODELS))
        local = stack.enter_context(
            gengate_server(
                MODELS, callers=LIMITED, server={"metrics": {"port": ports[0], "host": "127.0.0.1"}}
            )
        )
        shared = stack.enter_context(
            gengate_server(
                MODELS,
                callers=LIMITED,
                server={"metrics": {"port": ports[1], "host": "127.0.0.1"}, "state": state},
            )
        )
        threads = [scraper(f"http://127.0.0.1:{port}/metrics", stop) for port in ports]
        try:
            async with (
                AsyncClient(bare) as c_bare,
                AsyncClient(local, metadata=auth) as c_local,
                AsyncClient(shared, metadata=auth) as c_shared,
            ):
                made = [[0], [0], [0]]
                pids = [SERVER_PIDS[bare], SERVER_PIDS[local], SERVER_PIDS[shared]]
                cpu_before = [cpu_seconds(pid) for pid in pids] + [cpu_seconds(redis_pid)]
                variants = [
                    ("bare", unary_calls(c_bare, "echo", "hello world", 8, made[0])),
                    ("callers+quotas+metrics", unary_calls(c_local, "echo", "hello world", 8, made[1])),
                    ("... quotas in Redis", unary_calls(c_shared, "echo", "hello world", 8, made[2])),
                ]
                rows: list[RunStats] = []
                pairs: list[tuple[RunStats, RunStats]] = []
                for conc in (1, 8):
                    base, ops, ops_redis = await run_interleaved(variants, requests, conc, rounds)
                    rows += [base, ops, ops_redis]
                    pairs += [(ops, base), (ops_redis, base)]
                used = [cpu_seconds(pid) - b for pid, b in zip([*pids, redis_pid], cpu_before, strict=True)]
                calls = [count[0] for count in made]  # the paired rounds below count apart
                paired = await paired_cpu_ratios(variants, pids, redis_pid, cpu_rounds, cpu_requests)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
    print_table(f"unary echo, {requests * rounds} requests per variant", rows, tokens=False)
    summary = print_ratios(pairs, tokens=False)
    per_call = [1e6 * used[i] / calls[i] for i in range(3)]
    redis_per_call = 1e6 * used[3] / calls[2]
    print("\nserver CPU per call (its process, all runs and warm-ups):")
    ratio = per_call[1] / per_call[0]
    print(f"  bare {per_call[0]:.0f} µs; callers+quotas+metrics {per_call[1]:.0f} µs ({ratio:.3f}x);")
    print(
        f"  quotas in Redis {per_call[2]:.0f} µs + redis-server {redis_per_call:.0f} µs "
        f"({(per_call[2] + redis_per_call) / per_call[0]:.3f}x)"
    )
    for name, ratios in paired.items():
        ratios.sort()
        median = ratios[len(ratios) // 2]
        print(
            f"  paired rounds, {name} ÷ bare CPU per call: median {median:.3f}x "
            f"(middle half {ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f}, "
            f"{len(ratios)} rounds of {cpu_requests} calls at c=8)"
        )
    print(f"\nSUMMARY req/s ratios, 1.00 = as fast as bare: {', '.join(summary)}")
    medians = [sorted(r)[len(r) // 2] for r in paired.values()]
    print("SUMMARY CPU per call ÷ bare (paired medians): " + ", ".join(f"{m:.3f}" for m in medians))


async def paired_cpu_ratios(
    variants: list[tuple[str, Any]], pids: list[int], redis_pid: int, rounds: int, requests: int
) -> dict[str, list[float]]:
    """Each variant's server CPU per call ÷ bare's, round by round: the variants run right after
    one another in each round (so a busy moment of the machine weighs on both of a pair), and
    the median round is the estimate (a burst of other work on the machine spoils a few rounds,
    not the result). Each round reads the threads' CPU to the nanosecond (thread_cpu_seconds):
    /proc's 10 ms ticks alone would be ±2% of a round. The Redis variant counts redis-server's
    CPU too."""
    ratios: dict[str, list[float]] = {name: [] for name, _ in variants[1:]}
    for round_ in range(rounds):
        per_call = [0.0] * len(variants)
        order = list(range(len(variants)))
        if round_ % 2:  # every other round backwards: no variant always runs first
            order.reverse()
        for i in order:
            call, pid = variants[i][1], pids[i]
            watched = [pid, redis_pid] if i == 2 else [pid]
            before = sum(thread_cpu_seconds(p) for p in watched)
            await run_concurrent("cpu", call, requests, 8)
            per_call[i] = (sum(thread_cpu_seconds(p) for p in watched) - before) / requests
        for (name, _), value in zip(variants[1:], per_call[1:], strict=True):
            ratios[name].append(value / per_call[0])
    return ratios


async def across_processes(
    processes: int, rounds: int, requests: int
) -> tuple[float, float, list[float], list[float], float]:
    """Server CPU per call of `processes` bare servers and as many with callers, every quota and
    metrics (scraped every second), all interleaved (each round runs every server once, every
    other round in reverse order): one server process of either may run a few % faster or slower
    than another of the same code for its whole life (memory layout, hash seeds), which no
    number of rounds on one process averages out. The means over all calls, each process's, and
    req/s with operations ÷ bare over all of them (each side's calls ÷ its rounds' wall time)."""
    from gengate_client import AsyncClient

    os.environ[TOKEN_VARIABLE] = TOKEN
    auth = (("authorization", f"Bearer {TOKEN}"),)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    with contextlib.ExitStack() as stack:
        servers: list[tuple[str, bool]] = []  # (address, with operations)
        for _ in range(processes):
            servers.append((stack.enter_context(gengate_server(MODELS)), False))
            port = free_port()
            metrics = {"metrics": {"port": port, "host": "127.0.0.1"}}
            servers.append(
                (stack.enter_context(gengate_server(MODELS, callers=LIMITED, server=metrics)), True)
            )
            threads.append(scraper(f"http://127.0.0.1:{port}/metrics", stop))
        try:
            async with contextlib.AsyncExitStack() as clients:
                variants = []
                for address, operated in servers:
                    client = await clients.enter_async_context(
                        AsyncClient(address, metadata=auth if operated else ())
                    )
                    call = unary_calls(client, "echo", "hello world", 8)
                    await run_concurrent("warm-up", call, requests, 8)
                    variants.append((call, SERVER_PIDS[address]))
                used = [0.0] * len(variants)
                wall = [0.0] * len(variants)
                for round_ in range(rounds):
                    order = list(range(len(variants)))
                    if round_ % 2:
                        order.reverse()
                    for i in order:
                        call, pid = variants[i]
                        before = thread_cpu_seconds(pid)
                        stats = await run_concurrent("cpu", call, requests, 8)
                        used[i] += thread_cpu_seconds(pid) - before
                        wall[i] += stats.wall_s
        finally:
            stop.set()
            for thread in threads:
                thread.join()
    per_call = [1e6 * u / (rounds * requests) for u in used]
    bare, operated = per_call[0::2], per_call[1::2]
    throughput = sum(wall[0::2]) / sum(wall[1::2])  # the same calls each side: wall time's inverse
    return sum(bare) / processes, sum(operated) / processes, bare, operated, throughput


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--requests", type=int, default=None, help="requests per round (1000)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per variant (3)")
    parser.add_argument("--cpu-rounds", type=int, default=None, help="paired CPU rounds (21)")
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="server processes of each for the last figure (8; 0: skip it)",
    )
    args = parser.parse_args(argv)
    requests = args.requests or (200 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 3)
    cpu_rounds = args.cpu_rounds or (5 if args.quick else 21)
    asyncio.run(run(requests, rounds, cpu_rounds, 300 if args.quick else 1000))
    processes = args.processes if args.processes is not None else (1 if args.quick else 8)
    if processes > 0:
        spread_rounds = 4 if args.quick else 12
        spread_requests = 300 if args.quick else 500
        bare, operated, each_bare, each_operated, throughput = asyncio.run(
            across_processes(processes, spread_rounds, spread_requests)
        )
        print(
            f"\nserver CPU per call over {processes} processes of each "
            f"({spread_rounds} rounds of {spread_requests} calls at c=8):"
        )
        print(f"  bare {bare:.0f} µs (each: {', '.join(f'{v:.0f}' for v in each_bare)})")
        print(
            f"  callers+quotas+metrics {operated:.0f} µs "
            f"(each: {', '.join(f'{v:.0f}' for v in each_operated)})"
        )
        print(f"SUMMARY CPU per call ÷ bare over {processes} processes each: {operated / bare:.3f}")
        print(f"SUMMARY req/s ÷ bare over {processes} processes each (c=8): {throughput:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
