"""GPU placement: auto choice, explicit ids, sharing, cross-process exclusion, dead-pid reclaim, no NVML."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gengate.errors import ConfigError
from gengate.workers import placement as placement_mod
from gengate.workers.placement import (
    GpuInfo,
    NvmlDeviceProvider,
    PlacementError,
    PlacementFile,
    StaticDeviceProvider,
)

CONTENDER = str(Path(__file__).with_name("contender.py"))
GiB = 1 << 30


@pytest.fixture
def placement_path(tmp_path: Path) -> Path:
    return tmp_path / "placement.json"


def test_auto_picks_free_gpus_with_most_free_memory(placement_path: Path) -> None:
    provider = StaticDeviceProvider.fake(4, memory_free=[10 * GiB, 70 * GiB, 40 * GiB, 70 * GiB])
    placement = PlacementFile(placement_path, server_id="s1")
    first = placement.acquire("a", provider, num_gpus=2)
    assert first.devices == (1, 3)
    assert first.cuda_visible_devices == "1,3"
    second = placement.acquire("b", provider)
    assert second.devices == (2,)
    recorded = json.loads(placement_path.read_text())["leases"]
    assert {tuple(e["devices"]) for e in recorded} == {(1, 3), (2,)}
    assert all(e["server_id"] == "s1" for e in recorded)


def test_busy_gpus_refused_unless_shared(placement_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    provider = StaticDeviceProvider.fake(2)
    placement = PlacementFile(placement_path)
    placement.acquire("a", provider, num_gpus=2)
    with pytest.raises(PlacementError) as info:
        placement.acquire("b", provider)
    assert info.value.reason == "GPUS_BUSY"
    assert "'a'" in info.value.message
    with pytest.raises(PlacementError):
        placement.acquire("c", provider, devices=(1,))
    shared = placement.acquire("d", provider, devices=(1,), share=True)
    assert shared.devices == (1,)
    assert any("shares GPU" in r.message for r in caplog.records)


def test_explicit_ids_must_exist(placement_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"devices \[7\] do not exist"):
        PlacementFile(placement_path).acquire("a", StaticDeviceProvider.fake(2), devices=(7,))


def test_too_many_gpus_requested(placement_path: Path) -> None:
    with pytest.raises(PlacementError) as info:
        PlacementFile(placement_path).acquire("a", StaticDeviceProvider.fake(2), num_gpus=3)
    assert info.value.reason == "NOT_ENOUGH_GPUS"


def test_release_and_release_all(placement_path: Path) -> None:
    provider = StaticDeviceProvider.fake(2)
    placement = PlacementFile(placement_path)
    lease = placement.acquire("a", provider)
    placement.acquire("b", provider)
    placement.release(lease)
    assert [entry.model for entry in placement.leases()] == ["b"]
    placement.release_all()
    assert placement.leases() == []


def test_worker_pid_is_recorded(placement_path: Path) -> None:
    placement = PlacementFile(placement_path)
    lease = placement.acquire("a", StaticDeviceProvider.fake(1))
    placement.set_worker_pid(lease, 4242)
    assert placement.leases()[0].worker_pid == 4242


def test_dead_server_pid_is_reclaimed(placement_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, CONTENDER, str(placement_path), "doomed", "1", "die"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) == [0]
    assert len(json.loads(placement_path.read_text())["leases"]) == 1
    placement = PlacementFile(placement_path)
    assert placement.leases() == []
    assert placement.acquire("next", StaticDeviceProvider.fake(1)).devices == (0,)


def test_reused_pid_is_not_mistaken_for_the_holder() -> None:
    import os

    assert placement_mod.pid_alive(os.getpid(), placement_mod.process_start_token(os.getpid()))
    assert not placement_mod.pid_alive(os.getpid(), "1")
    assert not placement_mod.pid_alive(None)


def _spawn(path: Path, name: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, CONTENDER, str(path), name, "4", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_server_processes_never_hold_the_same_gpu(placement_path: Path) -> None:
    """Two real processes each ask for three one-GPU models (devices: auto) on four fake GPUs."""
    procs = [_spawn(placement_path, name, "hold", "3") for name in ("server-a", "server-b")]
    try:
        results = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        granted = [tuple(r) for result in results for r in result if isinstance(r, list)]
        refused = [r for result in results for r in result if isinstance(r, str)]
        assert len(granted) == 4 and refused == ["GPUS_BUSY"] * 2, results
        assert sorted(d for devices in granted for d in devices) == [0, 1, 2, 3]
        leases = json.loads(placement_path.read_text())["leases"]
        assert sorted(d for e in leases for d in e["devices"]) == [0, 1, 2, 3]
        assert {e["pid"] for e in leases} == {p.pid for p in procs}
    finally:
        for p in procs:
            p.communicate(timeout=30)
    assert PlacementFile(placement_path).leases() == []  # released at exit


def test_concurrent_churn_never_overlaps(placement_path: Path) -> None:
    """Three processes acquire, inspect and release in a loop; no GPU ever appears in two leases."""
    procs = [_spawn(placement_path, f"churn{i}", "churn", "15") for i in range(3)]
    outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr
        assert json.loads(stdout) == []


def test_nvml_absent_means_no_gpus(placement_path: Path) -> None:
    """This machine has no NVIDIA driver: NVML reports no GPU (not a crash) and placement says why."""
    provider = NvmlDeviceProvider()
    if provider.list_devices():
        pytest.skip("this machine has GPUs")
    assert provider.unavailable_reason
    with pytest.raises(PlacementError) as info:
        PlacementFile(placement_path).acquire("vllm-model", provider)
    assert info.value.reason == "NO_GPU"
    assert "needs a GPU but none is available" in info.value.message


def test_nvml_package_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    provider = NvmlDeviceProvider()
    assert provider.list_devices() == []
    assert "nvidia-ml-py" in (provider.unavailable_reason or "")


def test_nvml_lists_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVML path itself, against a stand-in pynvml module."""
    import types

    fake = types.SimpleNamespace(
        NVMLError=RuntimeError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80 * GiB, free=(h + 1) * GiB),
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}".encode(),
        nvmlDeviceGetName=lambda h: "H200",
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    devices = NvmlDeviceProvider().list_devices()
    assert devices == [
        GpuInfo(index=0, uuid="GPU-0", name="H200", memory_total=80 * GiB, memory_free=1 * GiB),
        GpuInfo(index=1, uuid="GPU-1", name="H200", memory_total=80 * GiB, memory_free=2 * GiB),
    ]
