"""distilabel pipelines against a real gengate server, in .venv-distilabel (scripts/setup-distilabel).

scripts/test runs these in the default run, as their own pytest call with `-m distilabel` and
GENGATE_REQUIRE_DISTILABEL=1. In a venv without distilabel (the main .venv) they are not collected
and nothing here changes that session; with the variable set a missing distilabel fails instead,
so a broken install cannot pass as green.

Nothing may reach the network and no cache may land in the home directory: distilabel's pipeline
cache and Hugging Face's caches go to a temp dir, the hub is offline, and Python sockets may only
reach loopback (distilabel fetches arxiv citations for a Distiset's card when it can; the forked
step processes inherit the guard).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_process import ServerProcess

TINY = {"models": [{"name": "tiny", "backend": "llamacpp", "tiny": True, "max_concurrency": 4}]}
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def _loopback(host: Any) -> bool:
    if isinstance(host, bytes):
        host = host.decode()
    if not isinstance(host, str):
        return False
    if host in _LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _isolate() -> None:
    """Caches into a temp dir, the hub offline, Python sockets to loopback only."""
    caches = Path(tempfile.mkdtemp(prefix="gengate-distilabel-"))
    os.environ.update(
        DISTILABEL_CACHE_DIR=str(caches / "distilabel"),
        HF_HOME=str(caches / "hf"),
        HF_DATASETS_CACHE=str(caches / "hf" / "datasets"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def check(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            raise OSError(f"tests/distilabel: network access to {address[0]} blocked")

    def guarded_connect(sock: socket.socket, address: Any) -> None:
        check(sock, address)
        connect(sock, address)

    def guarded_connect_ex(sock: socket.socket, address: Any) -> int:
        check(sock, address)
        return connect_ex(sock, address)

    def guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None and not _loopback(host):
            raise socket.gaierror(f"tests/distilabel: name lookup of {host!r} blocked")
        return getaddrinfo(host, *args, **kwargs)

    socket.socket.connect = guarded_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = guarded_connect_ex  # type: ignore[method-assign]
    socket.getaddrinfo = guarded_getaddrinfo


def _distilabel_installed() -> bool:
    # Not find_spec("distilabel"): with tests/ on sys.path this very folder is a namespace package
    # of that name; the installed distilabel is a regular package, found first where it exists.
    try:
        return importlib.util.find_spec("distilabel.models") is not None
    except ModuleNotFoundError:
        return False


if not _distilabel_installed():
    if os.environ.get("GENGATE_REQUIRE_DISTILABEL") == "1":
        raise RuntimeError(
            "GENGATE_REQUIRE_DISTILABEL=1: distilabel is not installed (scripts/setup-distilabel)"
        )
    collect_ignore_glob = ["test_*.py"]
else:
    _isolate()  # before any test module imports distilabel (datasets reads its cache dir on import)


@pytest.fixture(scope="session")
def gengate_address() -> Iterator[str]:
    """`gengate serve` on the tiny model (ChatML template), in its own process: distilabel runs its
    steps in forked processes, and a pipeline blocks the calling thread."""
    server = ServerProcess(TINY)
    try:
        yield server.address
    finally:
        server.stop()
