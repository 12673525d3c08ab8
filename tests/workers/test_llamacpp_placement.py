"""A llama.cpp worker given a GPU by placement (issue 12): the worker's CUDA_VISIBLE_DEVICES and
the engine's offload decision agree, through a real worker process on the tiny GGUF.

Placement here uses an injected device list (no GPU on this machine), so the worker is told GPU
1 is its own while llama-cpp-python is its CPU build: the default runs on the CPU saying so, an
explicit offload fails the start. bench/gpu/check.sh runs the real offload on a GPU.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (extra: llamacpp)")

import llama_cpp
from gengate.domain import GenerationRequest, StoppingCriteria
from gengate.models.tiny import TinyModelPaths
from gengate.workers.backend import GpuRequest, WorkerBackend, WorkerStartError
from gengate.workers.placement import PlacementFile, StaticDeviceProvider

pytestmark = pytest.mark.skipif(
    bool(llama_cpp.llama_supports_gpu_offload()), reason="a GPU build would try the injected GPU for real"
)


def _placed_worker(tiny_model: TinyModelPaths, tmp_path: Path, **options: object) -> WorkerBackend:
    return WorkerBackend(
        "tiny-llama",
        "llamacpp",
        {"path": str(tiny_model.gguf_path), **options},
        gpu=GpuRequest(num_gpus=1),
        placement=PlacementFile(tmp_path / "placement.json"),
        device_provider=StaticDeviceProvider.fake(2, memory_free=[1, 9]),  # auto takes GPU 1
        log_level="INFO",
    )


async def _worker_line(caplog: pytest.LogCaptureFixture, fragment: str, wait_s: float = 10.0) -> str:
    """The worker output line holding `fragment` (output is read beside the ready handshake)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for record in caplog.records:
            if fragment in record.getMessage():
                return record.getMessage()
        await asyncio.sleep(0.05)
    raise AssertionError(f"no worker output line with {fragment!r}")


async def test_placed_gpu_on_a_cpu_build_runs_on_the_cpu_and_says_so(
    tiny_model: TinyModelPaths, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _placed_worker(tiny_model, tmp_path)
    with caplog.at_level(logging.DEBUG, logger="gengate.workers.backend"):
        await backend.start()
        try:
            assert backend.lease is not None and backend.lease.devices == (1,)
            loaded = await _worker_line(caplog, "n_gpu_layers")
            assert loaded.endswith(
                "model 'tiny-llama': n_gpu_layers 0, all 3 layers on the CPU (CUDA_VISIBLE_DEVICES 1)"
            )
            warning = await _worker_line(caplog, "runs on the CPU although")
            assert "GPU(s) 1 were placed for it: this llama-cpp-python build has no GPU offload" in warning
            result = await backend.generate(
                GenerationRequest(model="tiny-llama", prompt="Hi", stopping=StoppingCriteria(max_tokens=3))
            )
            assert result.usage.output_tokens == 3
        finally:
            await backend.aclose()


async def test_explicit_offload_on_a_cpu_build_fails_the_worker_start(
    tiny_model: TinyModelPaths, tmp_path: Path
) -> None:
    backend = _placed_worker(tiny_model, tmp_path, n_gpu_layers=-1)
    with pytest.raises(WorkerStartError) as info:
        await backend.start()
    assert (
        "model 'tiny-llama': n_gpu_layers is -1, but this llama-cpp-python build has no GPU offload"
        in info.value.message
    )
    assert backend.lease is None  # the GPU went back when the start failed
