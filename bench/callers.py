"""What callers cost per call: the same unary calls on the model-free `scripted` echo, through
three `gengate serve` processes: no callers (authentication off), callers without quotas (the
token looked up, the caller made current), and callers with every quota on (requests and tokens
per minute, max_concurrency; set high enough never to refuse).

Ratios are req/s with callers / req/s without (1.00 = free), runs taken in turns. Then the
same work in this process without RPC: identifying the caller and admitting one call under all
quotas (charge and release included), in microseconds per call.

    .venv/bin/python bench/callers.py [--quick] [--requests N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from typing import Any

from common import gengate_server, print_ratios, print_table, run_interleaved, unary_calls

MODELS: list[dict[str, Any]] = [{"name": "echo", "backend": "scripted"}]
TOKEN_VARIABLE = "GENGATE_BENCH_TOKEN"
TOKEN = "bench-token-4f9a2c7e1d"
HUGE = 10**9
PLAIN = [{"name": "bench", "token_env": TOKEN_VARIABLE}]
LIMITED = [
    {
        "name": "bench",
        "token_env": TOKEN_VARIABLE,
        "requests_per_minute": HUGE,
        "tokens_per_minute": HUGE,
        "max_concurrency": 100_000,
        "priority": 5,
    }
]


async def run(requests: int, rounds: int) -> None:
    from gengate_client import AsyncClient

    os.environ[TOKEN_VARIABLE] = TOKEN
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with contextlib.ExitStack() as stack:
        none = stack.enter_context(gengate_server(MODELS))
        plain = stack.enter_context(gengate_server(MODELS, callers=PLAIN))
        limited = stack.enter_context(gengate_server(MODELS, callers=LIMITED))
        async with (
            AsyncClient(none) as c_none,
            AsyncClient(plain, metadata=auth) as c_plain,
            AsyncClient(limited, metadata=auth) as c_limited,
        ):
            variants = [
                ("no callers", unary_calls(c_none, "echo", "hello world", 8)),
                ("callers, no quotas", unary_calls(c_plain, "echo", "hello world", 8)),
                ("callers + quotas", unary_calls(c_limited, "echo", "hello world", 8)),
            ]
            rows = []
            pairs = []
            for conc in (1, 8):
                base, auth_only, quotas = await run_interleaved(variants, requests, conc, rounds)
                rows += [base, auth_only, quotas]
                pairs += [(auth_only, base), (quotas, base)]
    print_table(f"unary echo, {requests * rounds} requests per variant", rows, tokens=False)
    summary = print_ratios(pairs, tokens=False)
    print(f"\nSUMMARY req/s ratios, 1.00 = as fast as without callers: {', '.join(summary)}")


async def micro(calls: int) -> None:
    """Identify + admit + charge + release, in-process: what callers add to each call."""
    import time

    from gengate.callers.identity import CallerDirectory
    from gengate.callers.limits import Admission
    from gengate.config import parse_config

    config = parse_config({"models": MODELS, "callers": LIMITED})
    directory = CallerDirectory.from_config(config.callers, env={TOKEN_VARIABLE: TOKEN})
    assert directory is not None
    admission = Admission()
    metadata = [("user-agent", "grpc-python"), ("authorization", f"Bearer {TOKEN}")]
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            caller = directory.identify(metadata)
            admitted = await admission.admit(caller)
            await admitted.charge(12)
            admitted.release()
        best = min(best, (time.perf_counter() - started) / calls)
    print(
        f"\nin-process: identify + admit under every quota + charge + release: {best * 1e6:.1f} us per call"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--requests", type=int, default=None, help="requests per round (1000)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per variant (3)")
    args = parser.parse_args(argv)
    requests = args.requests or (200 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 3)
    asyncio.run(run(requests, rounds))
    asyncio.run(micro(20_000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
