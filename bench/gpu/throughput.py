"""Throughput of gengate → vLLM (gRPC, worker process) against vLLM's own OpenAI server.

Same model, same engine settings, same load: R requests, C at a time, greedy decoding (so both
sides generate the same tokens), max_tokens M. One side runs at a time on the GPU. Prints a
table and the ratio of output tokens/s (target ≥ 0.95); --json writes the numbers to a file.

usage: python bench/gpu/throughput.py --model HF_DIR [--requests 512] [--concurrency 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ENGINE_ARGS = {"max_model_len": 1024, "gpu_memory_utilization": 0.3}
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


def prompts(count: int) -> list[str]:
    return [f"Request {i}: tell me a long story about the number {i * 7919 % 1000}." for i in range(count)]


async def drive(
    call: Callable[[str], Awaitable[int]], requests: int, concurrency: int
) -> tuple[int, float, list[float]]:
    """Runs `call` over the prompts, `concurrency` at a time; returns tokens, wall time, latencies."""
    queue = list(reversed(prompts(requests)))
    latencies: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            prompt = queue.pop()
            began = time.perf_counter()
            tokens += await call(prompt)
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


def gengate_side(model: str, args: argparse.Namespace) -> Run:
    from gengate_client.aio import AsyncClient

    port = free_port()
    config = Path(tempfile.mkdtemp()) / "gengate.yaml"
    entry = {"name": SERVED_NAME, "backend": "vllm", "model": model, **ENGINE_ARGS}
    config.write_text(json.dumps({"models": [entry]}))  # JSON is YAML
    proc = subprocess.Popen(
        [sys.executable, "-m", "gengate", "serve", "--config", str(config), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_line(proc, "gengate serving on", 600)

        async def main() -> tuple[int, float, list[float]]:
            async with AsyncClient(f"127.0.0.1:{port}") as client:

                async def call(prompt: str) -> int:
                    reply = await client.generate(
                        SERVED_NAME, prompt, max_tokens=args.max_tokens, temperature=0.0
                    )
                    return int(reply.usage.output_tokens)

                await drive(call, args.concurrency, args.concurrency)  # warm-up
                return await drive(call, args.requests, args.concurrency)

        tokens, wall, lat = asyncio.run(main())
    finally:
        stop(proc)
    return Run("gengate -> vLLM", args.requests, tokens, wall, *percentiles(lat))


def vllm_side(model: str, args: argparse.Namespace) -> Run:
    import aiohttp

    port = free_port()
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
            str(ENGINE_ARGS["max_model_len"]),
            "--gpu-memory-utilization",
            str(ENGINE_ARGS["gpu_memory_utilization"]),
            "--enable-prefix-caching",
            "--disable-log-requests",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_line(proc, "Application startup complete", 600)

        async def main() -> tuple[int, float, list[float]]:
            limits = aiohttp.TCPConnector(limit=args.concurrency)
            async with aiohttp.ClientSession(connector=limits) as session:

                async def call(prompt: str) -> int:
                    body = {
                        "model": SERVED_NAME,
                        "prompt": prompt,
                        "max_tokens": args.max_tokens,
                        "temperature": 0.0,
                    }
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
                        response.raise_for_status()
                        return int((await response.json())["usage"]["completion_tokens"])

                await drive(call, args.concurrency, args.concurrency)  # warm-up
                return await drive(call, args.requests, args.concurrency)

        tokens, wall, lat = asyncio.run(main())
    finally:
        stop(proc)
    return Run("vLLM OpenAI server", args.requests, tokens, wall, *percentiles(lat))


def percentiles(latencies: list[float]) -> tuple[float, float]:
    ordered = sorted(latencies)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="HF model folder (no downloads here)")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("GENGATE_PLACEMENT_FILE", str(Path(tempfile.mkdtemp()) / "placement.json"))
    runs = [vllm_side(args.model, args), gengate_side(args.model, args)]
    ratio = runs[1].tokens_per_s / runs[0].tokens_per_s
    print(
        f"\nload: {args.requests} requests, {args.concurrency} concurrent, "
        f"max_tokens {args.max_tokens}, greedy"
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
    print(f"ratio gengate/vLLM (tok/s): {ratio:.3f}  (target >= 0.95: {verdict})")
    if runs[0].output_tokens != runs[1].output_tokens:
        print("note: the two sides generated different token counts (greedy decoding should match)")
    if args.json:
        data = {"runs": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in runs], "ratio": ratio}
        Path(args.json).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
