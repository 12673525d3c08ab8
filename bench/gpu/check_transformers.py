"""GPU check of NVML placement and the transformers engine on a real GPU (run by check.sh).

Everything goes through the real local path: NVML lists the GPU, the node's placement file
(`$GENGATE_PLACEMENT_FILE`) leases it, and a worker process started with `devices: auto` gets
CUDA_VISIBLE_DEVICES from that lease and runs the tiny model (gengate.models.tiny, built here:
no download) with `device: cuda`. Prints a line per check and a table; `--json` writes them.
`--cpu` runs the same checks with an injected one-GPU device list and the engine on CPU, to
test this script where there is no GPU (its numbers then say nothing about a GPU).

usage: python bench/gpu/check_transformers.py [--cpu] [--json FILE] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gengate.backend import collect_stream
from gengate.config import parse_config
from gengate.constraints import validate_output
from gengate.constraints.examples import EXAMPLE_CONSTRAINTS
from gengate.domain import (
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StoppingCriteria,
    StreamStart,
    StructuredOutput,
)
from gengate.models.tiny import build_tiny_model
from gengate.workers.backend import WorkerBackend
from gengate.workers.factory import build_backend
from gengate.workers.placement import (
    DeviceProvider,
    GpuInfo,
    NvmlDeviceProvider,
    PlacementError,
    PlacementFile,
    StaticDeviceProvider,
)

CHECK_TIMEOUT_S = 300.0
MIN_BATCH_RATIO = 1.5  # 16 concurrent vs one at a time: batching must at least help
GREEDY = SamplingParams(temperature=0.0, seed=0)


class Skipped(Exception):
    """A check that cannot run here (the message says why)."""


@dataclass
class Result:
    name: str
    status: str
    seconds: float
    detail: str


@dataclass
class Context:
    cpu_mode: bool
    model_dir: Path
    provider: DeviceProvider
    gpus: list[GpuInfo] = field(default_factory=list)
    gpu: WorkerBackend | None = None
    cpu: WorkerBackend | None = None
    numbers: dict[str, float] = field(default_factory=dict)

    def engine(self) -> WorkerBackend:
        if self.gpu is None:
            raise Skipped("the GPU worker did not start")
        return self.gpu


def request(prompt: str = "Once upon a time", **fields: object) -> GenerationRequest:
    fields.setdefault("stopping", StoppingCriteria(max_tokens=16))
    fields.setdefault("sampling", SamplingParams(temperature=1.0, seed=7))
    return GenerationRequest(model="tiny-gpu", prompt=prompt, **fields)  # type: ignore[arg-type]


def worker_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


# --- the checks, in order; each returns a one-line detail or raises ----------------------------


async def check_nvml(ctx: Context) -> str:
    ctx.gpus = await asyncio.to_thread(ctx.provider.list_devices)
    assert ctx.gpus, f"no GPU listed: {ctx.provider.unavailable_reason}"
    described = "; ".join(
        f"GPU {g.index} {g.name}: {g.memory_total / 2**30:.1f} GiB, {g.memory_free / 2**30:.1f} GiB free"
        for g in ctx.gpus
    )
    return ("(injected) " if ctx.cpu_mode else "") + described


async def check_placement_file(ctx: Context) -> str:
    mine = PlacementFile(server_id="gpu-check-a")
    other = PlacementFile(server_id="gpu-check-b")
    lease = await asyncio.to_thread(mine.acquire, "probe", ctx.provider, num_gpus=len(ctx.gpus))
    try:
        on_disk = json.loads(mine.path.read_text())["leases"]
        assert any(e["id"] == lease.id and e["pid"] == os.getpid() for e in on_disk), on_disk
        try:
            await asyncio.to_thread(other.acquire, "intruder", ctx.provider)
        except PlacementError as exc:
            assert exc.reason == "GPUS_BUSY", exc.reason
        else:
            raise AssertionError("a second server took a GPU that the placement file says is held")
    finally:
        await asyncio.to_thread(mine.release, lease)
    assert not any(e.id == lease.id for e in await asyncio.to_thread(mine.leases))
    return f"{mine.path}: lease of GPU(s) {lease.cuda_visible_devices}, second server refused, released"


async def check_worker_placement(ctx: Context) -> str:
    entry = {
        "name": "tiny-gpu",
        "backend": "transformers",
        "model": str(ctx.model_dir),
        "device": "cpu" if ctx.cpu_mode else "cuda",
        "devices": "auto",
        "max_batch_size": 16,
    }
    config = parse_config({"models": [entry]}).models[0]
    provider = ctx.provider if ctx.cpu_mode else None  # None: the worker backend asks NVML itself
    backend = build_backend(config, device_provider=provider)
    assert isinstance(backend, WorkerBackend)
    free_before = ctx.gpus[0].memory_free
    began = time.perf_counter()
    await backend.start()
    ctx.gpu = backend
    lease = backend.lease
    assert lease is not None and len(lease.devices) == 1, lease
    assert backend.pid is not None
    try:
        visible = worker_env(backend.pid).get("CUDA_VISIBLE_DEVICES")
    except OSError as exc:  # a sandbox may hide /proc/PID/environ; the lease is still checked below
        visible = f"(unreadable: {exc.strerror})"
    else:
        assert visible == lease.cuda_visible_devices, (visible, lease)
    on_disk = json.loads(PlacementFile().path.read_text())["leases"]
    assert any(e["id"] == lease.id and e["worker_pid"] == backend.pid for e in on_disk), on_disk
    used = ""
    if not ctx.cpu_mode:
        after = await asyncio.to_thread(ctx.provider.list_devices)
        used = f", GPU memory used by the worker ~{(free_before - after[0].memory_free) / 2**20:.0f} MiB"
    return (
        f"worker pid {backend.pid} ready in {time.perf_counter() - began:.1f} s, "
        f"CUDA_VISIBLE_DEVICES={visible} from the lease{used}"
    )


async def check_text(ctx: Context) -> str:
    result = await ctx.engine().generate(request())
    (gen,) = result.generations
    assert gen.text and gen.output_tokens > 0, gen
    assert result.usage.output_tokens == gen.output_tokens and result.usage.input_tokens > 0
    return f"{gen.output_tokens} tokens, finish {gen.finish_reason.name}"


async def check_stream(ctx: Context) -> str:
    events = [e async for e in ctx.engine().generate_stream(request())]
    assert isinstance(events[0], StreamStart) and isinstance(events[-1], GenerationEnd), events
    deltas = [e for e in events if isinstance(e, GenerationDelta)]
    assert len(deltas) > 1 and sum(d.token_count for d in deltas) == events[-1].usage.output_tokens
    return f"{len(deltas)} deltas"


def constraint_check(name: str) -> Callable[[Context], Awaitable[str]]:
    async def check(ctx: Context) -> str:
        structured = StructuredOutput(EXAMPLE_CONSTRAINTS[name])
        max_tokens = 200 if name == "json_object" else 60
        result = await ctx.engine().generate(
            request(n=2, structured_output=structured, stopping=StoppingCriteria(max_tokens=max_tokens))
        )
        assert result.enforcement is Enforcement.ENGINE, result.enforcement
        stopped = [g for g in result.generations if g.finish_reason is FinishReason.STOP]
        for gen in stopped:
            assert validate_output(structured, gen.text) is None, gen.text
        if name == "json_object":  # unbounded: a random model may run out of tokens inside it
            assert all(g.text.startswith("{") for g in result.generations), result.generations
        else:
            assert len(stopped) == 2, result.generations
        shown = " | ".join(repr(g.text[:40]) for g in result.generations)
        return f"{len(stopped)}/2 finished and valid: {shown}"

    return check


async def check_n2_seeded(ctx: Context) -> str:
    engine = ctx.engine()
    first = await engine.generate(request(n=2))
    again = await engine.generate(request(n=2))
    assert [g.index for g in first.generations] == [0, 1]
    texts = [g.text for g in first.generations]
    assert texts == [g.text for g in again.generations], (texts, again.generations)
    assert texts[0] != texts[1], "two generations of one seeded request should differ"
    return "same seed, same two texts; the two differ"


async def check_batching(ctx: Context) -> str:
    reqs = [request(f"Story {i}:", stopping=StoppingCriteria(max_tokens=32)) for i in range(16)]
    results = await asyncio.gather(*(collect_stream(ctx.engine().generate_stream(r)) for r in reqs))
    assert all(r.generations[0].output_tokens > 0 for r in results)
    return f"16 concurrent streams, {sum(r.usage.output_tokens for r in results)} tokens"


async def check_cpu_agreement(ctx: Context) -> str:
    entry = {"name": "tiny-cpu", "backend": "transformers", "model": str(ctx.model_dir), "device": "cpu"}
    backend = build_backend(parse_config({"models": [entry]}).models[0])
    assert isinstance(backend, WorkerBackend)
    await backend.start()
    ctx.cpu = backend
    reqs = [
        request(f"Day {i}: Monday", sampling=GREEDY, logprobs=0, stopping=StoppingCriteria(max_tokens=16))
        for i in range(8)
    ]
    on_gpu = await asyncio.gather(*(ctx.engine().generate(r) for r in reqs))
    on_cpu = await asyncio.gather(*(backend.generate(r) for r in reqs))

    def ids(result: GenerationResult) -> list[int | None]:
        return [lp.token_id for lp in result.generations[0].logprobs or ()]

    first_gpu, first_cpu = [ids(r)[:1] for r in on_gpu], [ids(r)[:1] for r in on_cpu]
    assert first_gpu == first_cpu, (first_gpu, first_cpu)
    same = sum(ids(g) == ids(c) for g, c in zip(on_gpu, on_cpu, strict=True))
    return f"first greedy token equal on 8/8 prompts; whole 16-token sequences equal on {same}/8"


async def check_throughput(ctx: Context) -> str:
    engine = ctx.engine()
    count, max_tokens = 16, 64
    reqs = [
        request(f"Request {i}:", sampling=GREEDY, stopping=StoppingCriteria(max_tokens=max_tokens))
        for i in range(count)
    ]
    await asyncio.gather(*(engine.generate(r) for r in reqs[:4]))  # warm-up

    began = time.perf_counter()
    sequential = [await engine.generate(r) for r in reqs]
    seq_s = time.perf_counter() - began
    began = time.perf_counter()
    concurrent = await asyncio.gather(*(engine.generate(r) for r in reqs))
    conc_s = time.perf_counter() - began

    seq_rate = sum(r.usage.output_tokens for r in sequential) / seq_s
    conc_rate = sum(r.usage.output_tokens for r in concurrent) / conc_s
    ratio = conc_rate / seq_rate
    ctx.numbers.update(sequential_tok_s=seq_rate, concurrent_tok_s=conc_rate, batch_ratio=ratio)
    detail = (
        f"{count} requests x {max_tokens} tokens: one at a time {seq_rate:.0f} tok/s, "
        f"16 concurrent {conc_rate:.0f} tok/s, ratio {ratio:.2f} (need >= {MIN_BATCH_RATIO})"
    )
    assert ratio >= MIN_BATCH_RATIO, detail
    return detail


async def check_release(ctx: Context) -> str:
    engine = ctx.engine()
    lease = engine.lease
    assert lease is not None
    await engine.aclose()
    ctx.gpu = None
    held = [e for e in await asyncio.to_thread(PlacementFile().leases) if e.id == lease.id]
    assert not held, held
    return "worker closed, its lease is gone from the placement file"


CHECKS: list[tuple[str, Callable[[Context], Awaitable[str]]]] = [
    ("nvml", check_nvml),
    ("placement file", check_placement_file),
    ("worker on GPU (devices: auto)", check_worker_placement),
    ("text", check_text),
    ("stream", check_stream),
    *((f"constraint {name}", constraint_check(name)) for name in EXAMPLE_CONSTRAINTS),
    ("n=2 seeded", check_n2_seeded),
    ("batching (16 concurrent)", check_batching),
    ("CPU vs GPU agreement", check_cpu_agreement),
    ("throughput ratio", check_throughput),
    ("lease released on close", check_release),
]


async def run_all(ctx: Context) -> list[Result]:
    results = []
    for name, check in CHECKS:
        began = time.perf_counter()
        try:
            detail, status = await asyncio.wait_for(check(ctx), CHECK_TIMEOUT_S), "PASS"
        except Skipped as exc:
            detail, status = str(exc), "SKIP"
        except Exception as exc:
            traceback.print_exc()
            detail, status = f"{type(exc).__name__}: {exc}"[:400], "FAIL"
        result = Result(name, status, time.perf_counter() - began, detail)
        print(f"[{status}] {name} ({result.seconds:.1f} s): {detail}", flush=True)
        results.append(result)
    for backend in (ctx.gpu, ctx.cpu):
        if backend is not None:
            await backend.aclose()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="no GPU: injected device list, engine on CPU")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "gengate-gpu-tiny"))
    args = parser.parse_args()
    if args.cpu:  # fake GPUs must not enter the node's real placement file
        os.environ.setdefault("GENGATE_PLACEMENT_FILE", str(Path(tempfile.mkdtemp()) / "placement.json"))
    model_dir = build_tiny_model(Path(args.model_dir)).hf_dir
    provider: DeviceProvider = StaticDeviceProvider.fake(1) if args.cpu else NvmlDeviceProvider()
    ctx = Context(cpu_mode=args.cpu, model_dir=model_dir, provider=provider)
    results = asyncio.run(run_all(ctx))
    print(f"\n{'transformers / placement check':<32} {'status':<6} {'s':>6}  detail")
    for r in results:
        print(f"{r.name:<32} {r.status:<6} {r.seconds:>6.1f}  {r.detail[:110]}")
    if args.json:
        data = {"cpu_mode": args.cpu, "results": [asdict(r) for r in results], "numbers": ctx.numbers}
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
