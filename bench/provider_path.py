"""The remote-provider path: what gengate adds over the openai SDK called directly, on one fake
OpenAI upstream (tests/providers/fake_openai.py in its own process), unary and streaming, c=1 and
c=32: added p50/p99 ms over direct, req/s, and the server's CPU time per request (its process's
user+system time during its own runs ÷ their requests; warm-ups and other variants' turns out).

`--provider anthropic|cohere|mistral|gemini|tgi` runs that backend on its fake instead
(tests/providers/fake_*.py, in its own process; TGI on its chat route), against that provider's
own SDK calling the fake directly (bench/direct_peers.py).

With `--base DIR` an older checkout's server runs beside this one as "before" (same Python, same
upstream, rounds interleaved: direct, gengate, before, direct, ...), and fast ÷ before ratios of
CPU per request and req/s are printed:

    git worktree add /tmp/base 82e0235
    .venv/bin/python bench/provider_path.py --base /tmp/base [--provider gemini] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common import SERVER_PIDS, Call, RunStats, cpu_seconds, gengate_server, run_interleaved
from direct_peers import direct_calls
from peers import UPSTREAM_KEY, UPSTREAM_MODEL, fake_process, fake_upstream, upstream_model
from sections import _added_over_direct, gengate_calls, openai_calls, ratio
from sections import row as stats_row

# A provider's fake (module, class) and its gengate model entry (given the fake's base URL).
FAKES: dict[str, tuple[str, str]] = {
    "anthropic": ("fake_anthropic", "FakeAnthropic"),
    "cohere": ("fake_cohere", "FakeCohere"),
    "mistral": ("fake_mistral", "FakeMistral"),
    "gemini": ("fake_gemini", "FakeGemini"),
    "tgi": ("fake_tgi", "FakeTGI"),
}
PROVIDERS = ("openai", *FAKES)
_SERVE = """
import sys
from {module} import API_KEY, {cls}
fake = {cls}()
print(fake.start(), API_KEY, flush=True)
sys.stdin.read()
fake.stop()
"""


@contextlib.contextmanager
def provider_upstream(provider: str) -> Iterator[dict[str, Any]]:
    """The provider's fake in its own process; yields the gengate model entry (`gpt`) for it."""
    if provider == "openai":
        with fake_upstream() as url:
            yield upstream_model(url)
        return
    module, cls = FAKES[provider]
    with fake_process(["-c", _SERVE.format(module=module, cls=cls)], provider) as line:
        url, _, key = line.partition(" ")
        yield {
            "name": "gpt",
            "backend": provider,
            "model": f"{provider}-fake",
            "base_url": url,
            "api_key": key,
        }


def _meter(pid: int) -> Callable[[], float]:
    """The CPU seconds process `pid` has used so far, read when called."""
    return lambda: cpu_seconds(pid)


async def measure(
    base: Path | None, c1: int, c32: int, rounds: int, provider: str = "openai"
) -> dict[str, Any]:
    import openai
    from gengate_client import AsyncClient

    result: dict[str, Any] = {"rows": [], "ratios": {}, "provider": provider}
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(provider_upstream(provider))
        servers = {"gengate": stack.enter_context(gengate_server([model]))}
        if base is not None:
            servers["before"] = stack.enter_context(gengate_server([model], repo=base))
        async with contextlib.AsyncExitStack() as clients:
            variants: list[tuple[str, tuple[Call, Call]]] = []
            if provider == "openai":
                direct = openai.AsyncOpenAI(base_url=model["base_url"], api_key=UPSTREAM_KEY, max_retries=0)
                clients.push_async_callback(direct.close)
                variants.append(("direct", openai_calls(direct, UPSTREAM_MODEL)))
            else:
                variants.append(("direct", await clients.enter_async_context(direct_calls(provider, model))))
            for name, address in servers.items():
                client = await clients.enter_async_context(AsyncClient(address))
                variants.append((name, gengate_calls(client, "gpt")))
            meters = {name: _meter(SERVER_PIDS[address]) for name, address in servers.items()}
            for mode, pick in (("unary", 0), ("stream", 1)):
                for concurrency, requests in ((1, c1), (32, c32)):
                    runs = [(name, calls[pick]) for name, calls in variants]
                    stats = await run_interleaved(runs, requests, concurrency, rounds, cpu=meters)
                    result["rows"] += _rows(stats, mode, set(meters))
    rows = {(r["variant"], r["mode"], r["concurrency"]): r for r in result["rows"]}
    if base is not None:
        for (variant, mode, concurrency), fast in rows.items():
            if variant != "gengate":
                continue
            before = rows["before", mode, concurrency]
            key = f"{mode} c={concurrency}"
            result["ratios"][f"{key} server CPU/request fast ÷ before"] = ratio(
                fast["server_cpu_ms_per_request"], before["server_cpu_ms_per_request"]
            )
            result["ratios"][f"{key} req/s fast ÷ before"] = ratio(fast["req_s"], before["req_s"])
    return result


def _rows(stats: list[RunStats], mode: str, served: set[str]) -> list[dict[str, Any]]:
    if stats[0].name in served:  # no direct peer (a provider other than OpenAI)
        nan = float("nan")
        rows = [stats_row(s, mode=mode, added_p50_ms=nan, added_p99_ms=nan, req_s_ratio=nan) for s in stats]
    else:
        rows = _added_over_direct(stats, mode)
    for row, run in zip(rows, stats, strict=True):
        if run.name in served:
            row["server_cpu_ms_per_request"] = round(1000 * run.cpu_s / run.requests, 3)
    return rows


def report(result: dict[str, Any]) -> None:
    head = f"  {'variant':<9} {'mode':<7} {'c':>3} {'req/s':>8} {'p50 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}"
    provider = result.get("provider", "openai")
    print(f"\nremote-provider path, one fake {provider} upstream (added = over the {provider} SDK direct)")
    print(head + f" {'CPU ms/req':>10}")
    for r in result["rows"]:
        cpu = r.get("server_cpu_ms_per_request")
        print(
            f"  {r['variant']:<9} {r['mode']:<7} {r['concurrency']:>3} {r['req_s']:>8.1f} {r['p50_ms']:>8.2f}"
            f" {r['added_p50_ms']:>8.2f} {r['added_p99_ms']:>8.2f} {'' if cpu is None else f'{cpu:10.3f}'}"
        )
    for name, value in result["ratios"].items():
        print(f"  {name:<48} {value:.3f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base", type=Path, help="an older checkout whose server runs as 'before'")
    parser.add_argument("--provider", choices=PROVIDERS, default="openai", help="the backend and its fake")
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per variant (3)")
    parser.add_argument("--json", type=Path, help="also write the rows and ratios here")
    args = parser.parse_args(argv)
    if args.base is not None and not (args.base / "server" / "gengate").is_dir():
        parser.error(f"--base {args.base}: no server/gengate there (a gengate checkout?)")
    c1, c32 = (30, 96) if args.quick else (150, 320)
    rounds = args.rounds or (1 if args.quick else 3)
    result = asyncio.run(measure(args.base, c1, c32, rounds, args.provider))
    result["setup"] = {
        "requests_c1": c1,
        "requests_c32": c32,
        "rounds": rounds,
        "base": str(args.base or ""),
        "provider": args.provider,
    }
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
