"""GPU placement: which worker may use which GPUs, agreed node-wide through a locked file.

NVML (the `nvidia-ml-py` package, module `pynvml`) lists the node's GPUs and their free
memory; a `DeviceProvider` interface lets tests inject a fake list. A JSON placement file,
guarded by a portalocker lock, records which process (server pid, server id, worker pid,
model) holds which GPUs, so several workers and several server processes on one node never
take the same GPU unless the model's config says `share_devices: true`. Entries whose
processes are gone are reclaimed by the next writer.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import portalocker

from gengate.errors import ConfigError, Unavailable

log = logging.getLogger(__name__)

PLACEMENT_FILE_ENV = "GENGATE_PLACEMENT_FILE"
DEFAULT_PLACEMENT_FILE = "/tmp/gengate-placement.json"
LOCK_TIMEOUT_S = 30.0

DeviceRequest = Literal["auto"] | tuple[int, ...]


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML numbers it (PCI bus order), with its memory in bytes."""

    index: int
    uuid: str = ""
    name: str = ""
    memory_total: int = 0
    memory_free: int = 0


class DeviceProvider(Protocol):
    """Lists the node's GPUs; an empty list means none (or no driver)."""

    def list_devices(self) -> list[GpuInfo]: ...

    @property
    def unavailable_reason(self) -> str | None:
        """Why no GPU is listed (no NVML library, no driver), or None."""
        ...


class NvmlDeviceProvider:
    """GPUs as NVML reports them; a missing library or driver means "no GPUs", never a crash."""

    def __init__(self) -> None:
        self._reason: str | None = None

    @property
    def unavailable_reason(self) -> str | None:
        return self._reason

    def list_devices(self) -> list[GpuInfo]:
        try:
            import pynvml
        except ImportError:
            self._reason = "the nvidia-ml-py package (module pynvml) is not installed"
            return []
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._reason = f"NVML is not available ({exc}): no NVIDIA driver or GPU on this node"
            return []
        try:
            devices = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                devices.append(
                    GpuInfo(
                        index=index,
                        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                        name=_text(pynvml.nvmlDeviceGetName(handle)),
                        memory_total=int(memory.total),
                        memory_free=int(memory.free),
                    )
                )
        except pynvml.NVMLError as exc:
            self._reason = f"NVML failed while listing GPUs: {exc}"
            return []
        finally:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
        self._reason = None if devices else "NVML lists no GPU on this node"
        return devices


class StaticDeviceProvider:
    """A fixed device list, for tests and for nodes where NVML must not be asked."""

    def __init__(self, devices: Sequence[GpuInfo]) -> None:
        self._devices = list(devices)

    @classmethod
    def fake(cls, count: int, *, memory_free: Sequence[int] | None = None) -> StaticDeviceProvider:
        """`count` fake GPUs of 80 GiB each; `memory_free` overrides their free memory."""
        free = list(memory_free) if memory_free is not None else [80 << 30] * count
        return cls(
            [
                GpuInfo(
                    index=i, uuid=f"GPU-fake-{i}", name="fake", memory_total=80 << 30, memory_free=free[i]
                )
                for i in range(count)
            ]
        )

    @property
    def unavailable_reason(self) -> str | None:
        return None if self._devices else "no GPUs in the injected device list"

    def list_devices(self) -> list[GpuInfo]:
        return list(self._devices)


class PlacementError(Unavailable):
    """No GPU could be assigned: none on the node, or all taken by other workers."""

    default_reason = "GPU_PLACEMENT"


@dataclass(frozen=True)
class Lease:
    """GPUs held by one model of one server process; the worker runs with exactly these."""

    id: str
    model: str
    devices: tuple[int, ...]
    server_id: str
    pid: int
    pid_start: str | None
    worker_pid: int | None = None
    shared: bool = False
    acquired_at: float = field(default_factory=time.time)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(d) for d in self.devices)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["devices"] = list(self.devices)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Lease:
        return cls(
            id=str(data["id"]),
            model=str(data.get("model", "")),
            devices=tuple(int(d) for d in data.get("devices", ())),
            server_id=str(data.get("server_id", "")),
            pid=int(data["pid"]),
            pid_start=data.get("pid_start"),
            worker_pid=data.get("worker_pid"),
            shared=bool(data.get("shared", False)),
            acquired_at=float(data.get("acquired_at", 0.0)),
        )


def process_start_token(pid: int) -> str | None:
    """The kernel's start time of `pid` (from /proc), to tell a live pid from a reused one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (starttime); the command name in field 2 may contain spaces, so split after ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def pid_alive(pid: int | None, start_token: str | None = None) -> bool:
    """Whether `pid` is a live process (and the same one, when its start token is known)."""
    if pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if start_token is not None:
        current = process_start_token(pid)
        if current is not None and current != start_token:
            return False
    # A zombie still answers kill(0); it holds no GPU.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def lease_alive(lease: Lease) -> bool:
    """A lease lives while its server or its worker lives (an orphaned worker still holds GPU memory)."""
    return pid_alive(lease.pid, lease.pid_start) or pid_alive(lease.worker_pid)


def default_placement_path() -> Path:
    return Path(os.environ.get(PLACEMENT_FILE_ENV) or DEFAULT_PLACEMENT_FILE)


def default_server_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class PlacementFile:
    """The node-wide record of GPU leases; every read-modify-write happens under one file lock."""

    def __init__(self, path: str | Path | None = None, *, server_id: str | None = None) -> None:
        self.path = Path(path) if path is not None else default_placement_path()
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.server_id = server_id or default_server_id()
        self._held: dict[str, Lease] = {}
        self._mutex = threading.Lock()
        atexit.register(self.release_all)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[list[Lease]]:
        """Yields the live leases under the lock; the list as left by the caller is written back."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with (
            self._mutex,
            portalocker.Lock(
                str(self.lock_path),
                mode="a",
                timeout=LOCK_TIMEOUT_S,
                check_interval=0.01,
                flags=portalocker.LOCK_EX | portalocker.LOCK_NB,
            ),
        ):
            leases = self._read()
            live = [lease for lease in leases if lease_alive(lease)]
            for dead in set(leases) - set(live):
                log.warning(
                    "placement: reclaiming GPUs %s of model %r held by dead process %d (server %s)",
                    dead.cuda_visible_devices,
                    dead.model,
                    dead.pid,
                    dead.server_id,
                )
            yield live
            self._write(live)

    def _read(self) -> list[Lease]:
        try:
            data = json.loads(self.path.read_text() or "{}")
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.error("placement: %s is unreadable (%s); starting from an empty record", self.path, exc)
            return []
        return [Lease.from_json(item) for item in data.get("leases", [])]

    def _write(self, leases: list[Lease]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps({"version": 1, "leases": [lease.to_json() for lease in leases]}, indent=1))
        os.replace(tmp, self.path)

    def leases(self) -> list[Lease]:
        """Every live lease on the node (dead ones are reclaimed on the way)."""
        with self._locked() as live:
            return list(live)

    def acquire(
        self,
        model: str,
        provider: DeviceProvider,
        *,
        devices: DeviceRequest = "auto",
        num_gpus: int = 1,
        share: bool = False,
        worker_pid: int | None = None,
    ) -> Lease:
        """Reserves GPUs for `model`: the requested ids, or with `auto` the free ones with most free memory.

        Raises PlacementError when the node has no GPU or not enough free ones, and ConfigError
        when an explicit id does not exist.
        """
        gpus = provider.list_devices()
        if not gpus:
            reason = provider.unavailable_reason or "no GPUs"
            raise PlacementError(
                f"model {model!r} needs a GPU but none is available: {reason}", reason="NO_GPU"
            )
        by_index = {gpu.index: gpu for gpu in gpus}
        with self._locked() as live:
            taken: dict[int, Lease] = {}
            for lease in live:
                for device in lease.devices:
                    taken.setdefault(device, lease)
            if devices == "auto":
                chosen = self._choose_auto(model, gpus, taken, num_gpus, share)
            else:
                chosen = self._check_explicit(model, devices, by_index, taken, share)
            lease = Lease(
                id=uuid.uuid4().hex,
                model=model,
                devices=tuple(chosen),
                server_id=self.server_id,
                pid=os.getpid(),
                pid_start=process_start_token(os.getpid()),
                worker_pid=worker_pid,
                shared=share,
            )
            live.append(lease)
            self._held[lease.id] = lease
        log.info("placement: model %r gets GPU(s) %s", model, lease.cuda_visible_devices)
        return lease

    @staticmethod
    def _choose_auto(
        model: str, gpus: list[GpuInfo], taken: dict[int, Lease], num_gpus: int, share: bool
    ) -> list[int]:
        if num_gpus > len(gpus):
            raise PlacementError(
                f"model {model!r} asks for {num_gpus} GPU(s) but the node has {len(gpus)}",
                reason="NOT_ENOUGH_GPUS",
            )
        by_memory = sorted(gpus, key=lambda g: (-g.memory_free, g.index))
        free = [g.index for g in by_memory if g.index not in taken]
        if len(free) >= num_gpus:
            return sorted(free[:num_gpus])
        if not share:
            holders = ", ".join(
                f"GPU {d}: {lease.model!r} (pid {lease.pid}, server {lease.server_id})"
                for d, lease in sorted(taken.items())
            )
            raise PlacementError(
                f"model {model!r} needs {num_gpus} free GPU(s), {len(free)} free; held: {holders}. "
                "Set share_devices: true to share on purpose.",
                reason="GPUS_BUSY",
            )
        shared = [g.index for g in by_memory if g.index in taken][: num_gpus - len(free)]
        log.warning("placement: model %r shares GPU(s) %s with other workers (share_devices)", model, shared)
        return sorted(free + shared)

    @staticmethod
    def _check_explicit(
        model: str, wanted: Sequence[int], by_index: dict[int, GpuInfo], taken: dict[int, Lease], share: bool
    ) -> list[int]:
        missing = [d for d in wanted if d not in by_index]
        if missing:
            raise ConfigError(
                f"model {model!r}: devices {missing} do not exist; this node has {sorted(by_index)}"
            )
        busy = {d: taken[d] for d in wanted if d in taken}
        if busy and not share:
            holders = ", ".join(
                f"GPU {d}: {lease.model!r} (pid {lease.pid})" for d, lease in sorted(busy.items())
            )
            raise PlacementError(
                f"model {model!r}: GPU(s) already held ({holders}); "
                "set share_devices: true to share on purpose",
                reason="GPUS_BUSY",
            )
        if busy:
            log.warning(
                "placement: model %r shares GPU(s) %s with other workers (share_devices)", model, sorted(busy)
            )
        return list(wanted)

    def set_worker_pid(self, lease: Lease, worker_pid: int | None) -> Lease:
        """Records the pid of the worker now running on `lease` (after each (re)start)."""
        from dataclasses import replace

        updated = replace(lease, worker_pid=worker_pid)
        with self._locked() as live:
            for i, entry in enumerate(live):
                if entry.id == lease.id:
                    live[i] = updated
        self._held[lease.id] = updated
        return updated

    def release(self, lease: Lease) -> None:
        """Gives the lease's GPUs back (model unloaded)."""
        self._held.pop(lease.id, None)
        with self._locked() as live:
            live[:] = [entry for entry in live if entry.id != lease.id]

    def release_all(self) -> None:
        """Releases every lease this object acquired; registered with atexit."""
        held = list(self._held.values())
        if not held:
            return
        ids = {lease.id for lease in held}
        self._held.clear()
        with contextlib.suppress(Exception), self._locked() as live:
            live[:] = [entry for entry in live if entry.id not in ids]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
