"""Builds a configured model's backend: local engines in worker processes, everything else inline.

`build_backend` fits the router's BackendFactory (`Router.from_config(config, factory=...)`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from gengate.backend import Backend
from gengate.config import ModelConfig, ServerConfig
from gengate.errors import ConfigError
from gengate.registry import backend_class, kinds_where
from gengate.workers.backend import GpuRequest, WorkerBackend
from gengate.workers.placement import DeviceProvider, DeviceRequest, PlacementFile

# Engines hosted by gengate itself, which can run in a worker process (`scripted` loads no model,
# so it stays inline unless asked: it is what tests of the service layer use).
LOCAL_ENGINES = kinds_where("engine")
PROCESS_BY_DEFAULT = kinds_where("engine", process_by_default=True)
# Need a GPU unless the config says `devices: cpu` (vLLM's CPU build): GPUs placed (devices: auto).
GPU_BY_DEFAULT = kinds_where("engine", gpu_by_default=True)
# Engines whose compute threads `cpu_threads` sets (vLLM's CPU build binds cores itself:
# `cpu_threads_bind`).
CPU_THREADED = kinds_where("engine", cpu_threaded=True)
# The thread-pool variables of the math libraries an engine may use (OpenMP: torch, llama.cpp's
# default here; MKL, OpenBLAS; rayon: Hugging Face tokenizers).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")

log = logging.getLogger(__name__)

_shared_placement: PlacementFile | None = None


def shared_placement() -> PlacementFile:
    """This server process's view of the node-wide placement file ($GENGATE_PLACEMENT_FILE)."""
    global _shared_placement
    if _shared_placement is None:
        _shared_placement = PlacementFile()
    return _shared_placement


def isolation_of(config: ModelConfig) -> str:
    """`process` or `inline`, after defaults."""
    if config.isolation is not None:
        return config.isolation
    return "process" if config.backend in PROCESS_BY_DEFAULT else "inline"


def gpu_request(config: ModelConfig) -> GpuRequest | None:
    """The GPUs a model asks for, or None for a CPU model."""
    if config.devices == "cpu":
        return None
    gpu_only = config.backend in GPU_BY_DEFAULT
    if config.devices is None and config.num_gpus is None:
        return GpuRequest(required=True) if gpu_only else None
    devices: DeviceRequest
    if config.devices is None or config.devices == "auto":
        devices = "auto"
    elif isinstance(config.devices, tuple):
        devices = config.devices
    else:
        raise ConfigError(f"model {config.name!r}: 'devices' must be 'auto' or a list of GPU indices")
    count = len(devices) if isinstance(devices, tuple) else (config.num_gpus or 1)
    return GpuRequest(devices=devices, num_gpus=count, share=config.share_devices, required=gpu_only)


def with_cpu_thread_shares(config: ServerConfig, cores: int | None = None) -> ServerConfig:
    """`config` with the node's cores split between its CPU engine workers that do not say
    `cpu_threads`, when there are several: each engine would otherwise start a thread per core
    and they would all fight over every core. Left alone when OMP_NUM_THREADS is set."""
    cpu_workers = [
        m
        for m in config.models
        if m.backend in CPU_THREADED and isolation_of(m) == "process" and gpu_request(m) is None
    ]
    unset = [m.name for m in cpu_workers if m.cpu_threads is None]
    if len(cpu_workers) < 2 or not unset or "OMP_NUM_THREADS" in os.environ:
        return config
    cores = cores or len(os.sched_getaffinity(0))
    taken = sum(m.cpu_threads or 0 for m in cpu_workers)
    share = max(1, (cores - taken) // len(unset))
    workers = len(cpu_workers)
    log.info("%d cores, %d CPU engine workers: %d thread(s) each for %s", cores, workers, share, unset)
    models = tuple(replace(m, cpu_threads=share) if m.name in unset else m for m in config.models)
    return replace(config, models=models)


def thread_environment(threads: int | None) -> dict[str, str]:
    """A worker's environment for `threads` compute threads (nothing when None)."""
    return {} if threads is None else dict.fromkeys(THREAD_VARIABLES, str(threads))


def build_backend(
    config: ModelConfig,
    *,
    placement: PlacementFile | None = None,
    device_provider: DeviceProvider | None = None,
) -> Backend:
    """The backend serving `config`; loading happens later, in `start()`."""
    check_model(config)
    gpu = gpu_request(config)
    if isolation_of(config) == "inline":
        backend: Backend = backend_class(config.backend)(config.name, config.options)
        return backend
    return WorkerBackend(
        config.name,
        config.backend,
        config.options,
        gpu=gpu,
        placement=placement or (shared_placement() if gpu is not None else None),
        device_provider=device_provider,
        env=thread_environment(config.cpu_threads),
    )


def check_model(config: ModelConfig) -> None:
    """The checks of a model entry that need its kind's facts (isolation, GPUs, threads, the
    extra installed): a ConfigError at start-up or from `gengate config check`, never a worker crash."""
    isolation = isolation_of(config)
    gpu = gpu_request(config)
    if config.backend not in LOCAL_ENGINES:
        if config.isolation == "process" or config.devices is not None or config.num_gpus is not None:
            raise ConfigError(
                f"model {config.name!r}: isolation/devices/num_gpus apply to local engines "
                f"({', '.join(sorted(LOCAL_ENGINES))}), not to {config.backend!r}"
            )
    if config.cpu_threads is not None:
        if config.backend not in CPU_THREADED:
            hint = "; vLLM's CPU build takes 'cpu_threads_bind'" if config.backend == "vllm" else ""
            raise ConfigError(
                f"model {config.name!r}: 'cpu_threads' applies to {', '.join(sorted(CPU_THREADED))}"
                f" workers, not to {config.backend!r}{hint}"
            )
        if isolation == "inline":
            raise ConfigError(
                f"model {config.name!r}: 'cpu_threads' needs 'isolation: process' "
                "(thread pools are set per worker process before the engine starts)"
            )
    if isolation == "inline" and gpu is not None:
        raise ConfigError(
            f"model {config.name!r}: GPU placement needs 'isolation: process' "
            "(CUDA_VISIBLE_DEVICES is set per worker process before CUDA starts)"
        )
    backend_class(config.backend)  # a missing extra is a config error now, not a worker crash later
