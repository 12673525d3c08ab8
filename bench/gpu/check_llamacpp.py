"""GPU check of the llama.cpp engine's offload in a worker placed on GPU 0 (run by check.sh).

Needs a llama-cpp-python built with GPU offload (check.sh finds or installs one, or skips). The
tiny GGUF (gengate.models.tiny, built here: no download) is served by a real worker process that
placement gives GPU 0 (`devices: [0]`); `n_gpu_layers` is left unset, so the engine must offload
every layer. Checked: the worker's CUDA_VISIBLE_DEVICES comes from the lease, llama.cpp's own
load log (as the engine reports it) puts every layer on CUDA0, the worker holds GPU memory
(NVML), text and a constraint on the GPU, the first greedy tokens equal a CPU worker's, an
explicit offload in a worker given no GPU fails its start, and the lease goes on close.
`--cpu` runs the same checks with an injected one-GPU list on the CPU build (every layer then
stays on the CPU, as the engine says), to test this script where there is no GPU.

usage: python bench/gpu/check_llamacpp.py [--cpu] [--json FILE] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gengate.domain import (
    ChoiceConstraint,
    Enforcement,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
)
from gengate.models.tiny import build_tiny_model
from gengate.workers.backend import GpuRequest, WorkerBackend, WorkerStartError
from gengate.workers.placement import DeviceProvider, NvmlDeviceProvider, PlacementFile, StaticDeviceProvider

CHECK_TIMEOUT_S = 240.0
LAYERS = 3  # the tiny model's 2 blocks and its output layer, as llama.cpp counts them
GREEDY = SamplingParams(temperature=0.0, seed=0)
# The engine's load line (gengate.engines.llamacpp), as the worker prints it.
LOAD_LINE = re.compile(r"model '[^']+': n_gpu_layers (-?\d+), (.+) \(CUDA_VISIBLE_DEVICES ([^)]*)\)")


@dataclass
class Result:
    name: str
    status: str
    seconds: float
    detail: str


class WorkerOutput(logging.Handler):
    """Worker output lines (WorkerBackend logs each at debug level) kept for the checks."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@dataclass
class Context:
    cpu_mode: bool
    gguf: Path
    provider: DeviceProvider
    output: WorkerOutput
    gpu: WorkerBackend | None = None
    cpu: WorkerBackend | None = None
    opened: list[WorkerBackend] = field(default_factory=list)

    def worker(self, name: str, **options: object) -> WorkerBackend:
        """A llama.cpp worker on the tiny GGUF; with `gpu` in options popped: placed on GPU 0."""
        gpu = options.pop("gpu", False)
        backend = WorkerBackend(
            name,
            "llamacpp",
            {"path": str(self.gguf), "n_ctx": 512, **options},
            gpu=GpuRequest(devices=(0,)) if gpu else None,
            device_provider=self.provider if gpu else None,
            log_level="INFO",  # the engine's load line says where the layers went
        )
        self.opened.append(backend)
        return backend

    def engine(self) -> WorkerBackend:
        if self.gpu is None:
            raise AssertionError("the GPU worker did not start")
        return self.gpu


def request(prompt: str = "Once upon a time", **fields: object) -> GenerationRequest:
    fields.setdefault("stopping", StoppingCriteria(max_tokens=16))
    fields.setdefault("sampling", SamplingParams(temperature=1.0, seed=7))
    return GenerationRequest(model="tiny-llama", prompt=prompt, **fields)  # type: ignore[arg-type]


def worker_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


async def load_line(ctx: Context, worker: str, wait_s: float = 10.0) -> re.Match[str]:
    """The engine's load line of `worker` (its output is read beside the ready handshake)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for line in ctx.output.lines:
            match = LOAD_LINE.search(line)
            if match and f"worker[{worker}]" in line:
                return match
        await asyncio.sleep(0.1)
    tail = "\n".join(ctx.output.lines[-20:])
    raise AssertionError(f"no load line from worker {worker!r}; its output ends:\n{tail}")


# --- the checks, in order; each returns a one-line detail or raises ----------------------------


async def check_build(ctx: Context) -> str:
    import llama_cpp

    offload = bool(llama_cpp.llama_supports_gpu_offload())
    assert offload or ctx.cpu_mode, "this llama-cpp-python build has no GPU offload"
    return f"llama-cpp-python {llama_cpp.__version__} from {llama_cpp.__file__}, GPU offload: {offload}"


async def check_placed_worker(ctx: Context) -> str:
    backend = ctx.worker("tiny-llama", gpu=True)
    began = time.perf_counter()
    await backend.start()
    ctx.gpu = backend
    lease = backend.lease
    assert lease is not None and lease.devices == (0,), lease
    assert backend.pid is not None
    try:
        visible = worker_env(backend.pid).get("CUDA_VISIBLE_DEVICES")
    except OSError as exc:  # a sandbox may hide /proc/PID/environ; the load line says it too
        visible = f"(unreadable: {exc.strerror})"
    else:
        assert visible == "0", visible
    match = await load_line(ctx, "tiny-llama")
    layers, placed, seen = int(match[1]), match[2], match[3]
    assert seen == "0", f"the engine saw CUDA_VISIBLE_DEVICES {seen!r}"
    if ctx.cpu_mode:
        assert (layers, placed) == (0, f"all {LAYERS} layers on the CPU"), match[0]
    else:
        assert layers == -1, f"n_gpu_layers {layers}: a placed GPU should offload every layer"
        assert placed == f"{LAYERS}/{LAYERS} layers offloaded (CUDA0: {LAYERS})", placed
    return (
        f"worker pid {backend.pid} ready in {time.perf_counter() - began:.1f} s, CUDA_VISIBLE_DEVICES="
        f"{visible}; engine: n_gpu_layers {layers}, {placed}"
    )


async def check_gpu_memory(ctx: Context) -> str:
    if ctx.cpu_mode:
        return "not measured (--cpu)"
    import pynvml

    pid = ctx.engine().pid
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    finally:
        pynvml.nvmlShutdown()
    used = {p.pid: p.usedGpuMemory for p in processes}
    if pid not in used:  # NVML reports host pids; inside a container they may not be ours
        return f"worker pid {pid} not among GPU 0's processes {sorted(used)} (pid namespace?)"
    return f"worker pid {pid} holds {(used[pid] or 0) / 2**20:.0f} MiB on GPU 0"


async def check_text_and_constraint(ctx: Context) -> str:
    engine = ctx.engine()
    text = await engine.generate(request())
    assert text.generations[0].output_tokens > 0, text
    choice = StructuredOutput(ChoiceConstraint(("yes", "no", "maybe")))
    chosen = await engine.generate(request("Ok?", structured_output=choice, n=2))
    assert chosen.enforcement is Enforcement.ENGINE, chosen.enforcement
    assert all(g.text in ("yes", "no", "maybe") for g in chosen.generations), chosen.generations
    return f"{text.generations[0].output_tokens} tokens; choice n=2: {[g.text for g in chosen.generations]}"


async def check_cpu_agreement(ctx: Context) -> str:
    backend = ctx.worker("tiny-llama-cpu", n_gpu_layers=0)
    await backend.start()
    ctx.cpu = backend
    reqs = [
        request(f"Day {i}: Monday", sampling=GREEDY, logprobs=0, stopping=StoppingCriteria(max_tokens=16))
        for i in range(8)
    ]
    on_gpu = [await ctx.engine().generate(r) for r in reqs]
    on_cpu = [await backend.generate(r) for r in reqs]

    def ids(result: GenerationResult) -> list[int | None]:
        return [lp.token_id for lp in result.generations[0].logprobs or ()]

    first_gpu, first_cpu = [ids(r)[:1] for r in on_gpu], [ids(r)[:1] for r in on_cpu]
    assert first_gpu == first_cpu, (first_gpu, first_cpu)
    same = sum(ids(g) == ids(c) for g, c in zip(on_gpu, on_cpu, strict=True))
    return f"first greedy token equal on 8/8 prompts; whole 16-token sequences equal on {same}/8"


async def check_offload_without_a_gpu(ctx: Context) -> str:
    backend = ctx.worker("tiny-llama-nogpu", n_gpu_layers=-1)  # a CPU worker: CUDA_VISIBLE_DEVICES=""
    try:
        await backend.start()
    except WorkerStartError as exc:
        expected = "no GPU offload" if ctx.cpu_mode else "this worker was given no GPU"
        assert expected in exc.message, exc.message
        return f"start refused: ...{exc.message.split('n_gpu_layers is -1, but ')[-1][:90]}"
    raise AssertionError("a worker with no GPU started with n_gpu_layers -1")


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
    ("llama-cpp-python build", check_build),
    ("worker on GPU 0, layers offloaded", check_placed_worker),
    ("worker holds GPU memory", check_gpu_memory),
    ("text and choice on the GPU", check_text_and_constraint),
    ("CPU vs GPU agreement", check_cpu_agreement),
    ("offload refused without a GPU", check_offload_without_a_gpu),
    ("lease released on close", check_release),
]


async def run_all(ctx: Context) -> list[Result]:
    results = []
    for name, check in CHECKS:
        began = time.perf_counter()
        try:
            detail, status = await asyncio.wait_for(check(ctx), CHECK_TIMEOUT_S), "PASS"
        except Exception as exc:
            traceback.print_exc()
            detail, status = f"{type(exc).__name__}: {exc}"[:400], "FAIL"
        result = Result(name, status, time.perf_counter() - began, detail)
        print(f"[{status}] {name} ({result.seconds:.1f} s): {detail}", flush=True)
        results.append(result)
        if status == "FAIL" and check is check_build:
            break  # nothing else can say anything about GPU offload
    for backend in ctx.opened:
        await backend.aclose()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="no GPU: injected device list, CPU build")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "gengate-gpu-tiny"))
    args = parser.parse_args()
    if args.cpu:  # fake GPUs must not enter the node's real placement file
        os.environ.setdefault("GENGATE_PLACEMENT_FILE", str(Path(tempfile.mkdtemp()) / "placement.json"))
    output = WorkerOutput()
    worker_log = logging.getLogger("gengate.workers.backend")
    worker_log.addHandler(output)
    worker_log.setLevel(logging.DEBUG)
    gguf = build_tiny_model(Path(args.model_dir)).gguf_path
    provider: DeviceProvider = StaticDeviceProvider.fake(1) if args.cpu else NvmlDeviceProvider()
    ctx = Context(cpu_mode=args.cpu, gguf=gguf, provider=provider, output=output)
    results = asyncio.run(run_all(ctx))
    print(f"\n{'llama.cpp offload check':<36} {'status':<6} {'s':>6}  detail")
    for r in results:
        print(f"{r.name:<36} {r.status:<6} {r.seconds:>6.1f}  {r.detail[:110]}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu_mode": args.cpu, "results": [asdict(r) for r in results]})
        )
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
