"""Opening a job store: `gengate serve` with a PostgreSQL store it cannot open stops in one
error line naming the store (exit 2, no traceback, never the password); a store made by the
version before jobs had owners (SQLite and PostgreSQL) opens, gets the `owner` column and keeps
its jobs, with idempotency keys per owner from then on."""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from gengate.jobs.model import JobOptions, JobState
from gengate.jobs.store import open_store

# The tables as the version before owners made them (its store.py, verbatim).
BEFORE_OWNERS = """
CREATE TABLE IF NOT EXISTS gengate_jobs (
    id TEXT PRIMARY KEY,
    display_name TEXT NOT NULL,
    idempotency_key TEXT UNIQUE,
    state TEXT NOT NULL,
    sealed INTEGER NOT NULL,
    total BIGINT NOT NULL,
    done BIGINT NOT NULL DEFAULT 0,
    failed BIGINT NOT NULL DEFAULT 0,
    input_tokens BIGINT NOT NULL DEFAULT 0,
    output_tokens BIGINT NOT NULL DEFAULT 0,
    cached_input_tokens BIGINT NOT NULL DEFAULT 0,
    offline INTEGER NOT NULL,
    priority INTEGER NOT NULL,
    max_concurrency INTEGER NOT NULL,
    create_time DOUBLE PRECISION NOT NULL,
    start_time DOUBLE PRECISION,
    end_time DOUBLE PRECISION,
    error TEXT NOT NULL DEFAULT '',
    provider_state TEXT
);
CREATE TABLE IF NOT EXISTS gengate_job_items (
    job_id TEXT NOT NULL,
    idx BIGINT NOT NULL,
    request {blob},
    result {blob},
    failed INTEGER NOT NULL DEFAULT 0,
    lease_owner TEXT,
    lease_until DOUBLE PRECISION,
    PRIMARY KEY (job_id, idx)
);
CREATE INDEX IF NOT EXISTS gengate_job_items_open ON gengate_job_items (job_id, idx) WHERE result IS NULL;
CREATE INDEX IF NOT EXISTS gengate_jobs_by_time ON gengate_jobs (create_time, id);
INSERT INTO gengate_jobs (id, display_name, idempotency_key, state, sealed, total, done, failed,
    output_tokens, offline, priority, max_concurrency, create_time, start_time, provider_state)
    VALUES ('job-old', 'made before owners', 'k', 'running', 1, 3, 1, 0, 7, 0, 2, 0, 100.0, 101.0, '{{}}');
INSERT INTO gengate_job_items (job_id, idx, request, result) VALUES ('job-old', 0, NULL, {ok});
INSERT INTO gengate_job_items (job_id, idx, request) VALUES ('job-old', 1, {req});
INSERT INTO gengate_job_items (job_id, idx, request) VALUES ('job-old', 2, {req})
"""

Execute = Callable[[str], list[tuple[object, ...]]]


@pytest.fixture(params=["sqlite", "postgresql"])
def old_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Execute]:
    """A store URL whose database holds the tables and one job of the version before owners,
    and a way to run SQL on it."""
    if request.param == "sqlite":
        path = tmp_path / "jobs.db"

        def execute(sql: str) -> list[tuple[object, ...]]:
            with contextlib.closing(sqlite3.connect(path)) as conn:
                rows = conn.execute(sql).fetchall()
                conn.commit()
                return rows

        schema = BEFORE_OWNERS.format(blob="BLOB", ok="X'6f6b'", req="X'7271'")
        url = f"sqlite:///{path}"
    else:
        server = request.getfixturevalue("postgres_server")
        url = str(request.getfixturevalue("postgres_url"))

        def execute(sql: str) -> list[tuple[object, ...]]:
            return server.execute(url, sql)

        schema = BEFORE_OWNERS.format(blob="BYTEA", ok="decode('6f6b', 'hex')", req="decode('7271', 'hex')")
    for statement in schema.split(";"):
        if statement.strip():
            execute(statement)
    return url, execute


def owner_columns(url: str, execute: Execute) -> list[str]:
    if url.startswith("sqlite"):
        return [str(row[1]) for row in execute("PRAGMA table_info(gengate_jobs)") if row[1] == "owner"]
    return [
        str(row[0])
        for row in execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'gengate_jobs' AND column_name = 'owner'"
        )
    ]


async def test_a_store_made_before_owners_opens_and_keeps_its_jobs(old_store: tuple[str, Execute]) -> None:
    url, execute = old_store
    assert owner_columns(url, execute) == []
    for start in range(2):  # the second start finds the column and changes nothing
        store = open_store(url)
        await store.open()
        try:
            job = await store.get("job-old")
            assert (job.owner, job.idempotency_key, job.display_name) == ("", "k", "made before owners")
            assert (job.state, job.total, job.done, job.usage.output_tokens) == (JobState.RUNNING, 3, 1, 7)
            assert (job.options.priority, job.create_time, job.start_time) == (2, 100.0, 101.0)
            assert await store.provider_state("job-old") == {}
            assert [(i, r is not None) for i, r in await store.results("job-old", -1, 10)] == [
                (0, True),
                (1, False),
                (2, False),
            ]
            assert [i.index for i in await store.lease("job-old", "runner", 5, 10.0)] == [1, 2]
            await store.release("job-old", "runner", [1, 2])
            assert "job-old" in [j.id for j in await store.runnable()]
            # The old key is the no-owner's; another owner's "k" is a job of its own.
            same, created = await store.create_job(
                display_name="again", idempotency_key="k", options=JobOptions(), items=[(b"r", None)]
            )
            assert not created and same.id == "job-old"
            theirs, created = await store.create_job(
                display_name="a",
                idempotency_key="k",
                options=JobOptions(),
                items=[(b"r", None)],
                owner="team-a",
            )
            assert theirs.owner == "team-a" and theirs.id != "job-old"
            assert created == (start == 0)
        finally:
            await store.close()
    assert owner_columns(url, execute) == ["owner"]
    if url.startswith("sqlite"):  # the table set aside for the rebuild is gone
        tables = {str(r[0]) for r in execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert tables == {"gengate_jobs", "gengate_job_items"}


def test_an_unreachable_postgres_store_stops_the_start_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("psycopg")
    with socket.socket() as sock:  # a port nothing listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = f"postgresql://gengate:s3cret-pw@127.0.0.1:{port}/x"
    config = tmp_path / "gengate.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": [{"name": "echo", "backend": "scripted"}],
                "server": {"host": "127.0.0.1", "port": 0, "jobs": {"store": store}},
            }
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "gengate", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GENGATE_DATA_DIR": str(tmp_path)},
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "s3cret-pw" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("gengate: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert f"the job store at postgresql://127.0.0.1:{port}/x cannot be opened" in errors[0]
    assert "OperationalError" in errors[0] and "refused" in errors[0]
