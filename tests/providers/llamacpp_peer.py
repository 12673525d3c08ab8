"""llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`) on a GGUF, started
as a third-party peer: by the provider tests (test_openai_llamacpp_server.py) and by bench/run."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """Ends a peer server: SIGTERM, then SIGKILL if it has not exited after `grace_s`."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_http(
    proc: subprocess.Popen[bytes],
    url: str,
    log_path: Path,
    timeout_s: float,
    what: str,
    headers: dict[str, str] | None = None,
) -> None:
    """Polls `url` until it answers 200; RuntimeError with the log's tail if the process exits,
    or when it does not answer within `timeout_s` (a peer server started as its own process)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up in {timeout_s:g} s") from None
            time.sleep(0.3)


@contextlib.contextmanager
def llamacpp_server(
    gguf: Path,
    log_path: Path,
    api_key: str,
    *,
    n_ctx: int = 512,
    n_threads: int = 1,
    python: str = sys.executable,
    timeout_s: float = 90.0,
) -> Iterator[str]:
    """Serves `gguf` on a free loopback port (chatml chat format, Bearer `api_key`); yields its
    base URL (without /v1) once /v1/models answers. RuntimeError, with the log's tail, if it
    exits or does not come up in `timeout_s`."""
    port = free_port()
    cmd = [
        python, "-m", "llama_cpp.server",
        "--model", str(gguf),
        "--host", "127.0.0.1", "--port", str(port),
        "--n_ctx", str(n_ctx), "--n_threads", str(n_threads), "--chat_format", "chatml",
        "--api_key", api_key,
    ]  # fmt: skip
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        headers = {"Authorization": f"Bearer {api_key}"}
        wait_http(proc, url + "/v1/models", log_path, timeout_s, "llama_cpp.server", headers)
        yield url
    finally:
        stop(proc, 10)
