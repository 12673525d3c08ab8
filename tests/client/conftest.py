"""Fixtures for client tests: one fake gengate server per session, reset before each test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_gengate import RunningFake


@pytest.fixture(scope="session")
def _fake_server() -> Iterator[RunningFake]:
    fake = RunningFake()
    yield fake
    fake.stop()


@pytest.fixture
def fake(_fake_server: RunningFake) -> RunningFake:
    _fake_server.reset()
    return _fake_server
