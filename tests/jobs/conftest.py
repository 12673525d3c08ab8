"""The jobs tests' PostgreSQL: one throwaway cluster per session (tests/jobs/postgres.py) and a
fresh database per test that asks for one."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from postgres import PostgresServer, Unavailable, start_postgres


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A real PostgreSQL on a free port of 127.0.0.1, stopped and deleted after the session.
    Skipped, naming what is missing, where PostgreSQL cannot be had; a failure instead under
    GENGATE_REQUIRE_EXTRAS=1."""
    pytest.importorskip("psycopg")  # strict under GENGATE_REQUIRE_EXTRAS=1 (tests/conftest.py)
    try:
        server = start_postgres()
    except Unavailable as exc:
        if os.environ.get("GENGATE_REQUIRE_EXTRAS") == "1":
            pytest.fail(f"GENGATE_REQUIRE_EXTRAS=1 and PostgreSQL is unavailable: {exc}", pytrace=False)
        pytest.skip(f"PostgreSQL is unavailable: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The URL of a database of its own for this test (no other test's jobs in it)."""
    return postgres_server.new_database()
