"""CLI tests reuse the client tests' fake server (tests/client/fake_gengate.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "client"))

from fake_gengate import RunningFake


@pytest.fixture(scope="session")
def _cli_fake_server() -> Iterator[RunningFake]:
    fake = RunningFake()
    yield fake
    fake.stop()


@pytest.fixture
def fake(_cli_fake_server: RunningFake) -> RunningFake:
    _cli_fake_server.reset()
    return _cli_fake_server
