"""A real redis-server for the shared-quota tests: in a temp folder on a free port, no
persistence, stopped after. The binary is looked for on PATH (and where Debian puts it); missing,
it is installed with `apt-get install -y redis-server` when that can run (root, apt-get present),
as tests/jobs/postgres.py does for PostgreSQL."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from debian_package import apt_install

_START_TIMEOUT_S = 30


class Unavailable(Exception):
    """redis-server cannot be had here; the message says why."""


def find_binary() -> str | None:
    return shutil.which("redis-server") or next(
        (str(p) for p in (Path("/usr/bin/redis-server"), Path("/usr/local/bin/redis-server")) if p.is_file()),
        None,
    )


def install_server() -> str:
    """Installs the Debian `redis-server` package; returns why it could not ('' when it did)."""
    return apt_install("redis-server")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; `stop()` and `start()` again keep its port (a Redis outage)."""

    def __init__(self) -> None:
        binary = find_binary()
        if binary is None:
            why = install_server()
            binary = find_binary()
            if binary is None:
                raise Unavailable(why or "redis-server is not installed")
        self.binary = binary
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="gengate-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._dir.name]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise Unavailable(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(15)
            self.proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()
