"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from gengate.api.server import RunningServer, start_server
from gengate.config import parse_config
from gengate.models.tiny import TinyModelPaths, build_tiny_model
from require_extras import strict_importorskip

# Servers started before any test's own folder is set (module-scoped fixtures, processes) keep
# their job store here, never in the home directory.
os.environ.setdefault("GENGATE_DATA_DIR", tempfile.mkdtemp(prefix="gengate-tests-data-"))

if os.environ.get("GENGATE_REQUIRE_EXTRAS") == "1":
    pytest.importorskip = strict_importorskip(pytest.importorskip)


@pytest.fixture(autouse=True)
def data_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's servers keep their job store in a fresh folder, never in the home directory."""
    path = tmp_path_factory.mktemp("data")
    monkeypatch.setenv("GENGATE_DATA_DIR", str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModelPaths:
    """The tiny local model (HF folder + GGUF), built once per session into $GENGATE_CACHE or a tmp dir."""
    cache = os.environ.get("GENGATE_CACHE")
    base = Path(cache).expanduser() if cache else tmp_path_factory.mktemp("gengate-cache")
    return build_tiny_model(base / "tiny")


@pytest.fixture
async def make_server() -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[RunningServer]]]:
    """Starts real servers on port 0 from config dicts; stops them all at the end of the test."""
    started: list[RunningServer] = []

    async def make(config: dict[str, Any]) -> RunningServer:
        server = await start_server(parse_config(config), host="127.0.0.1", port=0)
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop(grace=0.5)
