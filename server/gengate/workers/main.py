"""Engine worker process: `python -m gengate.workers.main --fd N`.

Started by WorkerBackend with its environment (CUDA_VISIBLE_DEVICES) already set, so nothing
here has touched CUDA before the engine loads. Reads a WorkerSpec from the socket on fd N,
loads the backend, answers Ready (or StartFailed), then runs calls concurrently until told to
shut down or until the server goes away (EOF), in which case it exits too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import logging
import os
import socket
import sys
import traceback
from typing import Any

from gengate.backend import Backend, aclose_stream
from gengate.logs import about_request, configure_logging
from gengate.observation import CallNotes, set_notes
from gengate.workers.protocol import (
    Abort,
    Aborted,
    Call,
    Done,
    ErrorPayload,
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

log = logging.getLogger("gengate.worker")
CLOSE_TIMEOUT_S = 10.0


class Outbox:
    """Batches the messages produced within one loop tick into one frame."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending: list[Any] = []

    def send(self, message: Any) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(message)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._writer.is_closing():
            self._writer.write(encode(pending))

    async def drain(self) -> None:
        self._flush()
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()


def load_backend(spec: WorkerSpec) -> Backend:
    """Imports the backend class named by the spec and builds it from its options."""
    module_name, _, class_name = spec.target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    options = cls.Options.model_validate(spec.options)
    backend: Backend = cls(spec.name, options)
    return backend


async def run_call(backend: Backend, call: Call, outbox: Outbox) -> None:
    """Runs one call, sending its events or result; cancellation (Abort) ends it silently.
    What the engine notes of the call (gengate.observation) goes back with its end."""
    with about_request(call.request.request_id, call.request.model):
        await _run_call(backend, call, outbox)


async def _run_call(backend: Backend, call: Call, outbox: Outbox) -> None:
    notes = CallNotes()
    set_notes(notes)  # this task's own context: the call's, until the task ends
    try:
        if call.stream:
            events = backend.generate_stream(call.request)
            try:
                async for event in events:
                    outbox.send(Event(call.call_id, event))
            finally:
                await aclose_stream(events)
            outbox.send(Done(call.call_id, notes=_sent(notes)))
        else:
            result = await backend.generate(call.request)
            outbox.send(Done(call.call_id, result, _sent(notes)))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.debug("call %d failed", call.call_id, exc_info=True)
        outbox.send(Failed(call.call_id, ErrorPayload.from_exception(exc), _sent(notes)))


def _sent(notes: CallNotes) -> CallNotes | None:
    """Notes worth sending: none when nothing was noted (most calls)."""
    return None if notes.empty() else notes


async def serve(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    outbox = Outbox(writer)
    (spec,) = await read_frame(reader)
    assert isinstance(spec, WorkerSpec)
    configure_logging(spec.log_level, spec.log_format, worker=spec.name)
    try:
        backend = load_backend(spec)
        await backend.start()
    except BaseException as exc:
        outbox.send(StartFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        await outbox.drain()
        traceback.print_exc()
        return 3
    outbox.send(Ready(os.getpid(), backend.capabilities))
    await outbox.drain()

    tasks: dict[int, asyncio.Task[None]] = {}  # calls not aborted, by id
    call_tasks: set[asyncio.Task[None]] = set()  # every call task until it is done
    try:
        while True:
            try:
                messages = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                log.warning("server connection closed; exiting")
                break
            stop = False
            for message in messages:
                if isinstance(message, Call):
                    task = asyncio.create_task(run_call(backend, message, outbox))
                    tasks[message.call_id] = task
                    call_tasks.add(task)
                    task.add_done_callback(call_tasks.discard)
                    task.add_done_callback(functools.partial(_forget, tasks, message.call_id))
                elif isinstance(message, Abort):
                    aborted = tasks.pop(message.call_id, None)
                    if aborted is not None:
                        aborted.cancel()
                        aborted.add_done_callback(functools.partial(_acknowledge, outbox, message.call_id))
                elif isinstance(message, Ping):
                    outbox.send(Pong(message.ping_id, len(tasks)))
                elif isinstance(message, Shutdown):
                    stop = True
            if stop:
                break
    finally:
        running = list(call_tasks)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        try:
            await asyncio.wait_for(backend.aclose(), CLOSE_TIMEOUT_S)
        except Exception:
            log.exception("closing the engine failed")
        await outbox.drain()
        writer.close()
    return 0


def _acknowledge(outbox: Outbox, call_id: int, _task: asyncio.Task[None]) -> None:
    outbox.send(Aborted(call_id))


def _forget(tasks: dict[int, asyncio.Task[None]], call_id: int, _task: asyncio.Task[None]) -> None:
    tasks.pop(call_id, None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="socket fd connected to the server")
    args = parser.parse_args(argv)
    sys.exit(asyncio.run(serve(args.fd)))


if __name__ == "__main__":
    main()
