"""WorkerBackend: any local engine backend, run in its own spawned process.

The server talks to the worker over a private socketpair (see protocol.py). Many calls are
multiplexed by call id; streams flow back as events; a cancelled or expired call sends Abort.
A dead worker (crash, kill -9, OOM kill) is seen at once as EOF on the socket: its in-flight
calls end with Unavailable, `serving` turns False (listeners are told, so gRPC health can say
NOT_SERVING), and the worker is restarted with exponential backoff. Other models' workers are
separate processes and are not affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import gengate
from gengate import errors
from gengate.backend import ServingListener
from gengate.deadline import within_deadline
from gengate.domain import GenerationRequest, GenerationResult, ModelCapabilities, StreamEvent
from gengate.logs import current_format, forward_worker_line, worker_log_level
from gengate.observation import CallNotes, current_notes
from gengate.registry import kind_spec
from gengate.workers.placement import DeviceProvider, DeviceRequest, Lease, PlacementError, PlacementFile
from gengate.workers.protocol import (
    Abort,
    Aborted,
    Call,
    Done,
    Event,
    Failed,
    Ping,
    Pong,
    Ready,
    Shutdown,
    StartFailed,
    WorkerSpec,
    encode,
    read_frame,
)

log = logging.getLogger(__name__)

OUTPUT_TAIL_LINES = 60
ABORT_ACK_TIMEOUT_S = 1.0


class WorkerStartError(errors.Unavailable):
    """The worker could not load its engine; the message carries the worker's own error and output tail."""

    default_reason = "WORKER_START_FAILED"


@dataclass(frozen=True)
class GpuRequest:
    """GPUs a worker needs: `devices` auto or explicit ids, how many, and whether sharing is allowed."""

    devices: DeviceRequest = "auto"
    num_gpus: int = 1
    share: bool = False
    # GPU-only engines (vLLM) fail to start without GPUs; others fall back to CPU with a warning.
    required: bool = True


class _Call:
    """One in-flight call on the server side: its inbox of worker messages."""

    def __init__(self, notes: CallNotes | None) -> None:
        self.inbox: asyncio.Queue[Event | Done | Failed | errors.GengateError] = asyncio.Queue()
        self.finished = False
        self.released: asyncio.Event = asyncio.Event()  # the worker has let go of the call
        self.notes = notes  # the routed call's notes, where the worker's notes of it go


class _Worker:
    """One incarnation of the worker process and its connection."""

    def __init__(
        self, process: asyncio.subprocess.Process, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.process = process
        self.reader = reader
        self.writer = writer
        self.output: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
        self.output_task: asyncio.Task[None] | None = None
        self.reader_task: asyncio.Task[None] | None = None
        self.started_at = time.monotonic()
        self.dead = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: Any) -> None:
        if not self.dead and not self.writer.is_closing():
            self.writer.write(encode([message]))

    def output_tail(self, lines: int = 25) -> str:
        return "\n".join(list(self.output)[-lines:])


class WorkerBackend:
    """A Backend whose engine runs in a worker process; see the module docstring."""

    def __init__(
        self,
        name: str,
        kind: str,
        options: BaseModel | Mapping[str, Any],
        *,
        target: str | None = None,
        gpu: GpuRequest | None = None,
        hide_gpus: bool = True,
        placement: PlacementFile | None = None,
        device_provider: DeviceProvider | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 600.0,
        restart_backoff_s: tuple[float, float] = (0.5, 30.0),
        stable_after_s: float = 30.0,
        log_level: str | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.capabilities = ModelCapabilities()
        self._target = target or kind_spec(kind).target
        # by alias: the worker validates them again, as a config file writes them
        self._options = options.model_dump(by_alias=True) if isinstance(options, BaseModel) else dict(options)
        self._gpu = gpu
        self._hide_gpus = hide_gpus
        self._placement = placement
        self._device_provider = device_provider
        self._extra_env = dict(env or {})
        self._start_timeout_s = start_timeout_s
        self._backoff_initial, self._backoff_max = restart_backoff_s
        self._backoff = self._backoff_initial
        self._stable_after_s = stable_after_s
        self._log_level = log_level
        self._lease: Lease | None = None
        self._worker: _Worker | None = None
        self._calls: dict[int, _Call] = {}
        self._pongs: dict[int, asyncio.Future[int]] = {}
        self._ids = itertools.count(1)
        self._serving = False
        self._closing = False
        self._listeners: list[ServingListener] = []
        self._restart_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.restarts = 0

    # --- observable state -------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """True while a worker is up and ready; False while starting, restarting or closed."""
        return self._serving

    @property
    def in_flight(self) -> int:
        """Calls sent to the worker and not yet finished."""
        return len(self._calls)

    @property
    def pid(self) -> int | None:
        """The current worker's pid, or None when none is running."""
        return self._worker.pid if self._worker is not None and not self._worker.dead else None

    @property
    def lease(self) -> Lease | None:
        """The GPUs this model holds, when it asked for any."""
        return self._lease

    @property
    def device_provider(self) -> DeviceProvider | None:
        """What lists the node's GPUs (NVML), once this model has asked for GPUs."""
        return self._device_provider

    def add_serving_listener(self, listener: ServingListener) -> None:
        """Calls `listener(serving)` on every change (from the event loop); it may return an awaitable."""
        self._listeners.append(listener)

    def _set_serving(self, serving: bool) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        level = logging.INFO if serving or self._closing else logging.WARNING
        log.log(level, "model %r %s", self.name, "is serving" if serving else "is NOT serving")
        for listener in self._listeners:
            try:
                outcome = listener(serving)
                if inspect.isawaitable(outcome):
                    self._spawn_background(outcome)
            except Exception:
                log.exception("serving listener of model %r failed", self.name)

    def _spawn_background(self, awaitable: Any) -> None:
        task = asyncio.ensure_future(awaitable)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def worker_in_flight(self, timeout_s: float = 5.0) -> int:
        """Asks the worker itself how many calls it runs (to check that aborts reached the engine)."""
        worker = self._require_worker()
        ping_id = next(self._ids)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pongs[ping_id] = future
        worker.send(Ping(ping_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pongs.pop(ping_id, None)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Takes GPUs (if any are needed), spawns the worker and waits for its Ready."""
        if self._gpu is not None:
            placement = self._placement or PlacementFile()
            self._placement = placement
            provider = self._device_provider
            if provider is None:
                from gengate.workers.placement import NvmlDeviceProvider

                provider = NvmlDeviceProvider()
                self._device_provider = provider  # metrics read the placed GPUs' memory through it
            gpu = self._gpu
            try:
                self._lease = await asyncio.to_thread(
                    placement.acquire,
                    self.name,
                    provider,
                    devices=gpu.devices,
                    num_gpus=gpu.num_gpus,
                    share=gpu.share,
                )
            except PlacementError as exc:
                if gpu.required or exc.reason != "NO_GPU":
                    raise
                log.warning("model %r runs on CPU: %s", self.name, exc.message)
        try:
            await self._spawn()
        except BaseException:
            await self._release_lease()
            raise

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self._extra_env)
        package_root = str(Path(gengate.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        if self._lease is not None:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # NVML numbers GPUs in PCI bus order
            env["CUDA_VISIBLE_DEVICES"] = self._lease.cuda_visible_devices
        elif self._hide_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU model must not grab a GPU by accident
        return env

    async def _spawn(self) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gengate.workers.main",
                "--fd",
                str(child_sock.fileno()),
                pass_fds=(child_sock.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=self._environment(),
                start_new_session=True,
            )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent_sock)
        worker = _Worker(process, reader, writer)
        worker.output_task = asyncio.create_task(self._pump_output(worker))
        worker.send(
            WorkerSpec(
                self.name,
                self.kind,
                self._target,
                self._options,
                self._log_level or worker_log_level(),
                current_format(),
            )
        )
        try:
            ready = await asyncio.wait_for(self._await_ready(worker), self._start_timeout_s)
        except TimeoutError:
            await self._kill(worker)
            raise WorkerStartError(
                f"worker of model {self.name!r} was not ready within {self._start_timeout_s:g} s; "
                f"its output:\n{worker.output_tail()}"
            ) from None
        except BaseException:
            await self._kill(worker)
            raise
        self.capabilities = ready.capabilities
        self._worker = worker
        if self._lease is not None and self._placement is not None:
            self._lease = await asyncio.to_thread(self._placement.set_worker_pid, self._lease, worker.pid)
        worker.reader_task = asyncio.create_task(self._read_loop(worker))
        log.info("model %r: worker pid %d ready", self.name, worker.pid)
        self._set_serving(True)

    async def _await_ready(self, worker: _Worker) -> Ready:
        try:
            messages = await read_frame(worker.reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await self._exit_code(worker, wait_s=5.0)
            raise WorkerStartError(
                f"worker of model {self.name!r} exited before it was ready ({_describe_exit(code)}); "
                f"its output:\n{worker.output_tail()}"
            ) from None
        first = messages[0]
        if isinstance(first, StartFailed):
            await self._exit_code(worker, wait_s=5.0)
            raise WorkerStartError(
                f"worker of model {self.name!r} failed to load the {self.kind} engine: {first.message}\n"
                f"worker output (tail):\n{worker.output_tail()}",
                metadata={"model": self.name},
            )
        if not isinstance(first, Ready):
            raise WorkerStartError(f"worker of model {self.name!r} sent {type(first).__name__} before Ready")
        return first

    async def _pump_output(self, worker: _Worker) -> None:
        """Keeps the tail of the worker's stdout/stderr for error messages and logs it at debug."""
        stream = worker.process.stdout
        if stream is None:
            return
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip()
            worker.output.append(text)
            if not forward_worker_line(self.name, text):  # a JSON log line keeps its level
                log.debug("worker[%s] %s", self.name, text)

    async def _exit_code(self, worker: _Worker, wait_s: float) -> int | None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(worker.process.wait(), wait_s)
        if worker.output_task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(worker.output_task), 1.0)
        return worker.process.returncode

    async def _read_loop(self, worker: _Worker) -> None:
        try:
            while True:
                for message in await read_frame(worker.reader):
                    self._dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except Exception:
            log.exception("model %r: bad message from worker; dropping it", self.name)
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()
        await self._on_worker_exit(worker)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, Event | Done | Failed | Aborted):
            call = self._calls.get(message.call_id)
            if call is None:
                return
            if isinstance(message, Aborted):
                call.released.set()
                return
            if not isinstance(message, Event):
                call.released.set()
                if message.notes is not None and call.notes is not None:
                    call.notes.merge(message.notes)
            call.inbox.put_nowait(message)
        elif isinstance(message, Pong):
            future = self._pongs.get(message.ping_id)
            if future is not None and not future.done():
                future.set_result(message.in_flight)

    async def _on_worker_exit(self, worker: _Worker) -> None:
        """EOF from the worker: fail its calls now, report NOT_SERVING, and restart unless closing."""
        worker.dead = True
        if self._worker is worker:
            self._worker = None
        self._set_serving(False)
        code = await self._exit_code(worker, wait_s=0.5)
        _kill_process_group(worker.pid)
        if time.monotonic() - worker.started_at >= self._stable_after_s:
            self._backoff = self._backoff_initial  # first, so the calls' RetryInfo is the real delay
        failure = errors.Unavailable(
            f"the worker of model {self.name!r} died ({_describe_exit(code)}); the model is restarting",
            reason="WORKER_DIED",
            retry_after_s=self._backoff,
        )
        for call in list(self._calls.values()):
            call.released.set()
            if not call.finished:
                call.inbox.put_nowait(failure)
        for future in self._pongs.values():
            if not future.done():
                future.set_exception(failure)
        worker.writer.close()
        if self._closing:
            return
        log.error(
            "model %r: worker pid %d died (%s); output tail:\n%s",
            self.name,
            worker.pid,
            _describe_exit(code),
            worker.output_tail(10),
        )
        self._restart_task = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        while not self._closing:
            delay = self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_max)
            log.warning("model %r: restarting its worker in %.1f s", self.name, delay)
            await asyncio.sleep(delay)
            if self._closing:
                return
            try:
                await self._spawn()
            except Exception as exc:
                log.error("model %r: restart failed: %s", self.name, exc)
                continue
            self.restarts += 1
            return

    async def _kill(self, worker: _Worker) -> None:
        worker.dead = True
        with contextlib.suppress(ProcessLookupError):
            worker.process.kill()
        await self._exit_code(worker, wait_s=5.0)
        _kill_process_group(worker.pid)
        worker.writer.close()

    async def aclose(self) -> None:
        """Stops the worker (Shutdown, then kill after a grace period) and releases its GPUs."""
        self._closing = True
        self._set_serving(False)
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart_task
        worker = self._worker
        if worker is not None:
            worker.send(Shutdown())
            with contextlib.suppress(ConnectionError):
                await worker.writer.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.process.wait(), 15.0)
            if worker.process.returncode is None:
                await self._kill(worker)
            _kill_process_group(worker.pid)
            if worker.reader_task is not None:
                await worker.reader_task
        await self._release_lease()

    async def _release_lease(self) -> None:
        if self._lease is not None and self._placement is not None:
            lease, self._lease = self._lease, None
            await asyncio.to_thread(self._placement.release, lease)

    # --- calls -------------------------------------------------------------------------------

    def _require_worker(self) -> _Worker:
        worker = self._worker
        if worker is None or worker.dead or not self._serving:
            state = (
                "closed"
                if self._closing
                else "restarting"
                if self.restarts or self._restart_task
                else "not started"
            )
            raise errors.Unavailable(
                f"model {self.name!r} is not serving ({state})",
                reason="MODEL_NOT_SERVING",
                retry_after_s=None if self._closing else self._backoff,
            )
        return worker

    async def _next(self, call: _Call, request: GenerationRequest) -> Event | Done | Failed:
        message = await within_deadline(
            call.inbox.get(),
            request,
            f"model {self.name!r} did not answer within the request's deadline",
            reason="DEADLINE",
        )
        if isinstance(message, errors.GengateError):
            raise message
        if isinstance(message, Failed):
            raise message.error.to_exception()
        return message

    @contextlib.asynccontextmanager
    async def _call(self, request: GenerationRequest, *, stream: bool) -> AsyncIterator[_Call]:
        worker = self._require_worker()
        call_id = next(self._ids)
        call = _Call(current_notes())
        self._calls[call_id] = call
        try:
            worker.send(Call(call_id, request, stream))
            yield call
        finally:
            try:
                if not call.finished and not call.released.is_set() and not worker.dead:
                    worker.send(Abort(call_id))
                    # Like an in-process engine, return once the engine has dropped the request
                    # (frees its batch slot and KV cache); past the deadline, do not wait.
                    left = request.time_left()
                    wait_s = ABORT_ACK_TIMEOUT_S if left is None else max(0.0, min(left, ABORT_ACK_TIMEOUT_S))
                    if wait_s > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(call.released.wait(), wait_s)
            finally:
                self._calls.pop(call_id, None)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        async with self._call(request, stream=False) as call:
            message = await self._next(call, request)
            call.finished = True
            if not isinstance(message, Done) or message.result is None:
                raise errors.Internal(
                    f"worker of model {self.name!r} sent {type(message).__name__} for a unary call"
                )
            return message.result

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        async with self._call(request, stream=True) as call:
            while True:
                message = await self._next(call, request)
                if isinstance(message, Done):
                    call.finished = True
                    return
                if isinstance(message, Event):
                    yield message.event


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill_process_group(pgid: int) -> None:
    """Kills what an engine started and left behind when its worker ended (vLLM's engine-core
    process, for one, would otherwise keep its GPU memory). Each worker leads its own process
    group (start_new_session), so the group is exactly the worker's descendants."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
