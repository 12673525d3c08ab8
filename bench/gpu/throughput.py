"""Throughput of gengate → vLLM (gRPC, worker process) against vLLM's own OpenAI server.

Same model, same engine settings, same load: R requests, C at a time, sampling with one seed per
request (so both sides generate the same tokens; greedy decoding on random weights ends in EOS
after a handful of tokens and would measure per-request cost only), max_tokens M. One server
runs at a time, each for --rounds rounds after a warm-up. Prints a table and the ratio of output
tokens/s (target ≥ 0.95); --json writes the numbers to a file.

usage: python bench/gpu/throughput.py --model HF_DIR [--device gpu|cpu] [--requests 512]
       [--concurrency 64] [--max-tokens 128] [--rounds 3]
--device cpu runs both sides on vLLM's CPU build (.venv-vllm): a check of gengate's own overhead
in front of vLLM, not a GPU number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

MAX_MODEL_LEN = 1024
SERVED_NAME = "small"


@dataclass
class Run:
    side: str
    requests: int
    output_tokens: int
    wall_s: float
    p50_latency_s: float
    p99_latency_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prompts(count: int) -> list[tuple[int, str]]:
    return [
        (i, f"Request {i}: tell me a long story about the number {i * 7919 % 1000}.") for i in range(count)
    ]


async def drive(
    call: Callable[[int, str], Awaitable[int]], requests: int, concurrency: int
) -> tuple[int, float, list[float]]:
    """Runs `call` over the prompts, `concurrency` at a time; returns tokens, wall time, latencies."""
    queue = list(reversed(prompts(requests)))
    latencies: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            seed, prompt = queue.pop()
            began = time.perf_counter()
            generated = await call(seed, prompt)  # awaited first: `tokens +=` would read a stale total
            tokens += generated
            latencies.append(time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens, time.perf_counter() - began, latencies


def wait_for_line(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    tail: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("server exited before it was ready:\n" + "".join(tail[-40:]))
        tail.append(line)
        if marker in line:
            return
    raise RuntimeError(f"server not ready within {timeout_s} s:\n" + "".join(tail[-40:]))


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def engine_settings(device: str) -> tuple[dict[str, object], list[str], dict[str, str]]:
    """Same engine settings for both sides: gengate config keys, vLLM server flags, environment."""
    if device == "cpu":
        # float32: see tests/vllm/conftest.py (bfloat16 kernels die on CPUs that list but block AMX).
        # vLLM's CPU model runner spins its OpenMP threads on every core it is given; leave one
        # core to the serving processes (vLLM's advice), or both sides measure CPU starvation:
        # on 2 cores gengate's extra process then waited ~1 s for a core while its server-side
        # time was 0.3 s.
        bind = f"0-{max(0, (os.cpu_count() or 2) - 2)}"
        entry = {
            "devices": "cpu",
            "dtype": "float32",
            "cpu_kv_cache_gb": 2,
            "cpu_threads_bind": bind,
            "enforce_eager": True,
        }
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": bind}
        return entry, ["--dtype", "float32", "--enforce-eager"], env
    return {"gpu_memory_utilization": 0.3}, ["--gpu-memory-utilization", "0.3"], {}


@contextlib.contextmanager
def gengate_server(model: str, device: str) -> Iterator[str]:
    port = free_port()
    config = Path(tempfile.mkdtemp()) / "gengate.yaml"
    extra, _, env = engine_settings(device)
    entry = {
        "name": SERVED_NAME,
        "backend": "vllm",
        "model": model,
        "max_model_len": MAX_MODEL_LEN,
        "max_concurrency": 1024,
        **extra,
    }
    config.write_text(json.dumps({"models": [entry]}))  # JSON is YAML
    proc = subprocess.Popen(
        [sys.executable, "-m", "gengate", "serve", "--config", str(config), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
    )
    try:
        wait_for_line(proc, "gengate serving on", 600)
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc)


@contextlib.contextmanager
def vllm_server(model: str, device: str) -> Iterator[str]:
    port = free_port()
    _, flags, env = engine_settings(device)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--enable-prefix-caching",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
    )
    try:
        wait_for_line(proc, "Application startup complete", 600)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


async def gengate_load(address: str, args: argparse.Namespace) -> tuple[int, float, list[float]]:
    from gengate_client.aio import AsyncClient

    async with AsyncClient(address) as client:

        async def call(seed: int, prompt: str) -> int:
            reply = await client.generate(
                SERVED_NAME, prompt, max_tokens=args.max_tokens, temperature=1.0, seed=seed
            )
            return int(reply.usage.output_tokens)

        await drive(call, args.concurrency, args.concurrency)  # warm-up
        return await drive(call, args.requests, args.concurrency)


async def vllm_load(base_url: str, args: argparse.Namespace) -> tuple[int, float, list[float]]:
    import aiohttp

    limits = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=limits) as session:

        async def call(seed: int, prompt: str) -> int:
            body = {
                "model": SERVED_NAME,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 1.0,
                "seed": seed,
            }
            async with session.post(f"{base_url}/v1/completions", json=body) as response:
                response.raise_for_status()
                return int((await response.json())["usage"]["completion_tokens"])

        await drive(call, args.concurrency, args.concurrency)  # warm-up
        return await drive(call, args.requests, args.concurrency)


def percentiles(latencies: list[float]) -> tuple[float, float]:
    ordered = sorted(latencies)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="HF model folder (no downloads here)")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: vLLM's CPU build")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("GENGATE_PLACEMENT_FILE", str(Path(tempfile.mkdtemp()) / "placement.json"))
    # One server up at a time: an idle vLLM stack beside a busy one slowed the busy one 2-8x on a
    # 2-core machine (vLLM's CPU workers poll), which measured the neighbour, not gengate.
    vllm_runs: list[Run] = []
    gengate_runs: list[Run] = []
    with vllm_server(args.model, args.device) as base_url:
        for _ in range(args.rounds):
            measured = summarise(asyncio.run(vllm_load(base_url, args)))
            vllm_runs.append(Run("vLLM OpenAI server", args.requests, *measured))
    with gengate_server(args.model, args.device) as address:
        for _ in range(args.rounds):
            measured = summarise(asyncio.run(gengate_load(address, args)))
            gengate_runs.append(Run("gengate -> vLLM", args.requests, *measured))
    runs = vllm_runs + gengate_runs
    ratio = statistics.median(r.tokens_per_s for r in gengate_runs) / statistics.median(
        r.tokens_per_s for r in vllm_runs
    )
    print(
        f"\nload ({args.device}): {args.requests} requests, {args.concurrency} concurrent, "
        f"max_tokens {args.max_tokens}, seeded sampling, {args.rounds} rounds per side"
    )
    print(
        f"{'side':<20} {'out tokens':>10} {'wall s':>8} {'tok/s':>10} {'req/s':>8} {'p50 s':>7} {'p99 s':>7}"
    )
    for run in runs:
        print(
            f"{run.side:<20} {run.output_tokens:>10} {run.wall_s:>8.2f} {run.tokens_per_s:>10.0f} "
            f"{run.requests_per_s:>8.1f} {run.p50_latency_s:>7.3f} {run.p99_latency_s:>7.3f}"
        )
    verdict = "PASS" if ratio >= 0.95 else "BELOW TARGET"
    print(f"ratio gengate/vLLM (median tok/s over rounds): {ratio:.3f}  (target >= 0.95: {verdict})")
    if len({run.output_tokens for run in runs}) > 1:
        print("note: the sides generated different token counts (seeded sampling should match)")
    if args.json:
        data = {
            "device": args.device,
            "runs": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in runs],
            "ratio": ratio,
        }
        Path(args.json).write_text(json.dumps(data, indent=1))


def summarise(measured: tuple[int, float, list[float]]) -> tuple[int, float, float, float]:
    tokens, wall, latencies = measured
    return (tokens, wall, *percentiles(latencies))


if __name__ == "__main__":
    main()
