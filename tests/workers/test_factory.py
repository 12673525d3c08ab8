"""Config keys isolation/devices/num_gpus/share_devices/cpu_threads and the backend factory."""

from __future__ import annotations

from pathlib import Path

import pytest
from gengate.config import parse_config
from gengate.engines.scripted import ScriptedBackend
from gengate.errors import ConfigError
from gengate.workers.backend import GpuRequest, WorkerBackend
from gengate.workers.factory import (
    THREAD_VARIABLES,
    build_backend,
    gpu_request,
    isolation_of,
    with_cpu_thread_shares,
)
from gengate.workers.placement import PlacementError, PlacementFile, StaticDeviceProvider


def model(**entry: object):  # type: ignore[no-untyped-def]
    return parse_config({"models": [{"name": "m", "backend": "scripted", **entry}]}).models[0]


def test_defaults() -> None:
    config = model()
    assert (config.isolation, config.devices, config.num_gpus, config.share_devices) == (
        None,
        None,
        None,
        False,
    )
    assert isolation_of(config) == "inline"
    assert isinstance(build_backend(config), ScriptedBackend)
    assert gpu_request(config) is None


def test_process_isolation_and_devices() -> None:
    config = model(isolation="process", devices=[2, 0], share_devices=True)
    assert config.devices == (2, 0)
    assert gpu_request(config) == GpuRequest(devices=(2, 0), num_gpus=2, share=True, required=False)
    backend = build_backend(config)
    assert isinstance(backend, WorkerBackend) and backend.kind == "scripted"
    assert gpu_request(model(isolation="process", devices="auto", num_gpus=2)) == GpuRequest(
        "auto", 2, False, required=False
    )
    assert gpu_request(model(isolation="process", num_gpus=3)) == GpuRequest("auto", 3, required=False)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"isolation": "thread"}, "'isolation' must be"),
        ({"devices": "all"}, "'devices' must be"),
        ({"devices": [0, 0]}, "'devices' must be"),
        ({"devices": [-1]}, "'devices' must be"),
        ({"num_gpus": 0}, "'num_gpus' must be"),
        ({"devices": [0, 1], "num_gpus": 1}, "'num_gpus' is 1 but 'devices' lists 2"),
        ({"share_devices": "yes"}, "'share_devices' must be"),
    ],
)
def test_bad_keys_name_the_entry(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        model(**entry)
    assert "models[0] (m)" in str(info.value)


def test_gpu_keys_need_process_isolation() -> None:
    with pytest.raises(ConfigError, match="needs 'isolation: process'"):
        build_backend(model(devices="auto"))


def test_vllm_always_asks_for_a_gpu() -> None:
    from dataclasses import replace

    config = replace(model(), backend="vllm")
    assert gpu_request(config) == GpuRequest(required=True)
    assert isolation_of(config) == "process"


def test_vllm_with_devices_cpu_asks_for_no_gpu() -> None:
    from dataclasses import replace

    config = parse_config(
        {"models": [{"name": "v", "backend": "vllm", "model": "/m", "devices": "cpu"}]}
    ).models[0]
    assert config.devices == "cpu" and gpu_request(config) is None
    assert gpu_request(replace(config, devices=None)) == GpuRequest(required=True)
    with pytest.raises(ConfigError, match="'num_gpus' does not go with 'devices: cpu'"):
        parse_config(
            {"models": [{"name": "v", "backend": "vllm", "model": "/m", "devices": "cpu", "num_gpus": 1}]}
        )


def test_devices_on_a_remote_provider_is_a_config_error() -> None:
    config = parse_config(
        {"models": [{"name": "p", "backend": "openai", "model": "gpt-x", "api_key": "k", "devices": "cpu"}]}
    ).models[0]
    with pytest.raises(ConfigError, match="apply to local engines"):
        build_backend(config)


async def test_cpu_engine_with_devices_auto_runs_on_cpu_without_gpus(tmp_path: Path) -> None:
    backend = build_backend(
        model(isolation="process", devices="auto"),
        placement=PlacementFile(tmp_path / "p.json"),
        device_provider=StaticDeviceProvider([]),
    )
    await backend.start()
    try:
        assert isinstance(backend, WorkerBackend) and backend.serving and backend.lease is None
    finally:
        await backend.aclose()


async def test_gpu_only_engine_without_gpus_is_a_clear_start_error(tmp_path: Path) -> None:
    backend = WorkerBackend(
        "needs-gpu",
        "scripted",
        {},
        gpu=GpuRequest(required=True),
        placement=PlacementFile(tmp_path / "p.json"),
        device_provider=StaticDeviceProvider([]),
    )
    with pytest.raises(PlacementError, match="needs a GPU but none is available") as info:
        await backend.start()
    assert info.value.reason == "NO_GPU" and backend.pid is None


# --- cpu_threads: compute threads of CPU engine workers ---------------------------------------


def server(*entries: dict[str, object]):  # type: ignore[no-untyped-def]
    return parse_config({"models": list(entries)})


def test_cores_are_split_between_cpu_workers_that_do_not_say(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = server(
        {"name": "a", "backend": "llamacpp", "tiny": True},
        {"name": "b", "backend": "transformers", "tiny": True},
        {"name": "c", "backend": "llamacpp", "tiny": True, "cpu_threads": 2},
        {"name": "gpu", "backend": "transformers", "tiny": True, "devices": [0]},  # not a CPU worker
        {"name": "inline", "backend": "llamacpp", "tiny": True, "isolation": "inline"},
        {"name": "s", "backend": "scripted"},
    )
    shares = {m.name: m.cpu_threads for m in with_cpu_thread_shares(config, cores=16).models}
    assert shares == {"a": 7, "b": 7, "c": 2, "gpu": None, "inline": None, "s": None}
    assert with_cpu_thread_shares(config, cores=2).models[0].cpu_threads == 1  # never below one


def test_one_cpu_worker_or_omp_num_threads_leaves_threads_to_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    alone = server({"name": "a", "backend": "llamacpp", "tiny": True}, {"name": "s", "backend": "scripted"})
    assert with_cpu_thread_shares(alone, cores=16) == alone
    two = server(
        {"name": "a", "backend": "llamacpp", "tiny": True}, {"name": "b", "backend": "llamacpp", "tiny": True}
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert with_cpu_thread_shares(two, cores=16) == two


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"backend": "llamacpp", "tiny": True, "cpu_threads": 0}, "'cpu_threads' must be a positive integer"),
        ({"backend": "vllm", "model": "x", "devices": "cpu", "cpu_threads": 2}, "takes 'cpu_threads_bind'"),
        ({"backend": "scripted", "cpu_threads": 2}, "applies to llamacpp, mlx, transformers workers"),
        (
            {"backend": "llamacpp", "tiny": True, "isolation": "inline", "cpu_threads": 2},
            "needs 'isolation: process'",
        ),
    ],
)
def test_cpu_threads_where_it_cannot_apply_is_a_config_error(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_backend(parse_config({"models": [{"name": "m", **entry}]}).models[0])


async def test_a_workers_thread_pools_follow_cpu_threads() -> None:
    import psutil

    config = parse_config({"models": [{"name": "m", "backend": "llamacpp", "tiny": True, "cpu_threads": 1}]})
    backend = build_backend(config.models[0])
    assert isinstance(backend, WorkerBackend)
    await backend.start()
    try:
        assert backend.pid is not None
        environ = psutil.Process(backend.pid).environ()
        assert {key: environ.get(key) for key in THREAD_VARIABLES} == dict.fromkeys(THREAD_VARIABLES, "1")
    finally:
        await backend.aclose()


def test_llama_cpp_threads_come_from_n_threads_then_omp_num_threads() -> None:
    from gengate.engines.llamacpp import compute_threads

    assert compute_threads(3, {"OMP_NUM_THREADS": "1"}) == 3
    assert compute_threads(None, {"OMP_NUM_THREADS": "2"}) == 2
    assert compute_threads(None, {"OMP_NUM_THREADS": "two"}) is None
    assert compute_threads(None, {}) is None
