"""Local streams through `gengate serve`: frames per stream, p50, req/s and server CPU per stream,
for the model-free `scripted` echo (its tokens all ready at once) and the tiny llama.cpp model in
its worker process, at c=1 and c=8.

With `--base DIR` an older checkout's server runs beside this one (same Python, rounds
interleaved), e.g. to see what merging queued deltas into one frame (server/gengate/api/coalesce.py)
changes:

    git worktree add /tmp/base d73f1b4
    .venv/bin/python bench/stream_frames.py --base /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from pathlib import Path
from typing import Any

from common import SERVER_PIDS, Call, cpu_seconds, gengate_server, run_interleaved

MODELS: list[dict[str, Any]] = [
    {"name": "tiny", "backend": "llamacpp", "tiny": True},
    {"name": "echo", "backend": "scripted"},
]
# model, max_tokens, requests a round
RUNS = (("echo", 16, 400), ("tiny", 32, 150))


def streamer(client: Any, model: str, max_tokens: int) -> Call:
    """One stream read to its end; returns its frame count (RunStats counts them as tokens)."""

    async def call(i: int) -> int:
        frames = 0
        async for _ in client.generate_stream(
            model, "Once upon a time there was", max_tokens=max_tokens, seed=i, temperature=1.0
        ):
            frames += 1
        return frames

    return call


async def run(servers: dict[str, str], rounds: int, scale: float) -> None:
    from gengate_client import AsyncClient

    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(AsyncClient(addr)) for name, addr in servers.items()}
        print(f"{'variant':18s} {'c':>3s} {'req/s':>8s} {'p50 ms':>8s} {'frames':>7s} {'CPU ms/req':>10s}")
        for model, max_tokens, requests in RUNS:
            for concurrency in (1, 8):
                variants = [(f"{n} {model}", streamer(c, model, max_tokens)) for n, c in clients.items()]
                cpu = {
                    f"{name} {model}": (lambda addr=addr: cpu_seconds(SERVER_PIDS[addr]))
                    for name, addr in servers.items()
                }
                count = max(8, int(requests * scale))
                rows = await run_interleaved(variants, count, concurrency, rounds, cpu=cpu)
                for r in rows:
                    print(
                        f"{r.name:18s} {concurrency:3d} {r.requests_per_s:8.1f} "
                        f"{1e3 * statistics.median(r.latencies_s):8.2f} {r.tokens / r.requests:7.1f} "
                        f"{1e3 * r.cpu_s / r.requests:10.3f}"
                    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base", type=Path, help="an older checkout whose server runs beside this one")
    parser.add_argument("--quick", action="store_true", help="one round, fewer requests (a smoke run)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        servers = {"this": stack.enter_context(gengate_server(MODELS))}
        if args.base is not None:
            servers["before"] = stack.enter_context(gengate_server(MODELS, repo=args.base))
        asyncio.run(run(servers, 1 if args.quick else 3, 0.1 if args.quick else 1.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
