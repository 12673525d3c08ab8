"""Where jobs live: one SQL store for SQLite (embedded, the default) and PostgreSQL (several
replicas sharing jobs), written once for both DB-API drivers.

Every result is written the moment its item finishes, in the same transaction as the job's
counters. An item is run under a lease (owner + expiry); a result is stored only while the item
has none, so every index ends with exactly one result however runners die or race. Leases of a
runner that died expire (`lease_s`), and on this host a dead process's leases are released at
once (`release_dead_local`), so a restarted server resumes without waiting. All SQL runs in one
thread per store: the event loop never waits on disk or network.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlparse

from gengate.errors import ConfigError, FailedPrecondition, NotFound
from gengate.jobs.model import ItemResult, Job, JobOptions, JobState, JobUsage, LeasedItem

T = TypeVar("T")

# Items inserted per statement batch while creating a job.
INSERT_CHUNK = 2000


@dataclass(frozen=True)
class _Dialect:
    name: str
    placeholder: str
    blob: str
    skip_locked: str  # row-locking suffix for leasing ("" where the database has one writer)
    # Run before creating the tables: replicas starting together create (and migrate) them one
    # at a time (PostgreSQL's CREATE TABLE IF NOT EXISTS is not safe against a concurrent one;
    # SQLite's BEGIN IMMEDIATE takes the write lock and makes the start-up one transaction).
    schema_lock: str


_SQLITE = _Dialect("sqlite", "?", "BLOB", "", "BEGIN IMMEDIATE")
_POSTGRES = _Dialect(
    "postgresql",
    "%s",
    "BYTEA",
    " FOR UPDATE SKIP LOCKED",
    "SELECT pg_advisory_xact_lock(7164203215640104548)",
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS gengate_jobs (
    id TEXT PRIMARY KEY,
    display_name TEXT NOT NULL,
    idempotency_key TEXT,
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
    provider_state TEXT,
    owner TEXT NOT NULL DEFAULT ''
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
CREATE INDEX IF NOT EXISTS gengate_jobs_by_owner ON gengate_jobs (owner, create_time, id);
CREATE UNIQUE INDEX IF NOT EXISTS gengate_jobs_owner_key ON gengate_jobs (owner, idempotency_key);
"""

_INSERT_ITEMS = "INSERT INTO gengate_job_items (job_id, idx, request, result, failed) VALUES (?, ?, ?, ?, ?)"
_JOB_COLUMNS = (
    "id, display_name, idempotency_key, state, sealed, total, done, failed, input_tokens, "
    "output_tokens, cached_input_tokens, offline, priority, max_concurrency, create_time, "
    "start_time, end_time, error, owner"
)
# A store made before jobs had owners: gengate_jobs without `owner`, its idempotency_key UNIQUE
# on its own (keys are per owner now). PostgreSQL alters the table; SQLite cannot drop a
# column's UNIQUE, so the table is rebuilt (it holds one row per job: the items stay as they are).
_BEFORE_OWNER_COLUMNS = (
    "id, display_name, idempotency_key, state, sealed, total, done, failed, input_tokens, "
    "output_tokens, cached_input_tokens, offline, priority, max_concurrency, create_time, "
    "start_time, end_time, error, provider_state"
)
_POSTGRES_ADD_OWNER = (
    "ALTER TABLE gengate_jobs ADD COLUMN IF NOT EXISTS owner TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE gengate_jobs DROP CONSTRAINT IF EXISTS gengate_jobs_idempotency_key_key",
)
_SQLITE_SET_ASIDE = (
    "ALTER TABLE gengate_jobs RENAME TO gengate_jobs_before_owner",
    "DROP INDEX IF EXISTS gengate_jobs_by_time",  # it moved with the table; made again on the new one
)
_SQLITE_COPY_BACK = (
    f"INSERT INTO gengate_jobs ({_BEFORE_OWNER_COLUMNS}) "
    f"SELECT {_BEFORE_OWNER_COLUMNS} FROM gengate_jobs_before_owner",
    "DROP TABLE gengate_jobs_before_owner",
)


def runner_identity() -> str:
    """This process's lease owner name: host, pid and a token unique to this start."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _job(row: Sequence[Any]) -> Job:
    return Job(
        id=row[0],
        display_name=row[1],
        idempotency_key=row[2] or "",
        state=JobState(row[3]),
        sealed=bool(row[4]),
        total=int(row[5]),
        done=int(row[6]),
        failed=int(row[7]),
        usage=JobUsage(int(row[8]), int(row[9]), int(row[10])),
        options=JobOptions(offline=bool(row[11]), priority=int(row[12]), max_concurrency=int(row[13])),
        create_time=float(row[14]),
        start_time=None if row[15] is None else float(row[15]),
        end_time=None if row[16] is None else float(row[16]),
        error=row[17] or "",
        owner=row[18] or "",
    )


class JobStore:
    """Jobs, their items and results in SQL. Open with `open_store(url)`."""

    def __init__(
        self, connect: Callable[[], Any], dialect: _Dialect, where: str, secrets: Sequence[str] = ()
    ) -> None:
        self._connect = connect
        self._dialect = dialect
        self.where = where  # for messages: the path or host, never a password
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)  # kept out of messages
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gengate-jobs")
        self._closed = False
        self._conn: Any = None

    # -- plumbing ---------------------------------------------------------------------------

    def _sql(self, text: str) -> str:
        return text.replace("?", self._dialect.placeholder) if self._dialect.placeholder != "?" else text

    async def _run(self, fn: Callable[[Any], T]) -> T:
        """Runs `fn(connection)` in one transaction on the store's thread."""

        def call() -> T:
            if self._conn is None or getattr(self._conn, "closed", False):
                # The server went away (a restart, a failover, an idle connection cut): the call
                # that found out failed; this one connects again.
                self._conn = self._connect()
            conn = self._conn
            try:
                result = fn(conn)
                conn.commit()
                return result
            except BaseException:
                with contextlib.suppress(Exception):  # a broken connection cannot roll back
                    conn.rollback()
                raise

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def open(self) -> None:
        """Connects and creates the tables; ConfigError (one line) when the store cannot be opened."""

        def setup() -> None:
            try:
                self._conn = self._connect()
                cur = self._conn.cursor()
                if self._dialect.schema_lock:
                    cur.execute(self._dialect.schema_lock)
                rebuild = self._migrate(cur)
                for statement in _SCHEMA.format(blob=self._dialect.blob).split(";"):
                    if statement.strip():
                        cur.execute(statement)
                if rebuild:
                    for statement in _SQLITE_COPY_BACK:
                        cur.execute(statement)
                self._conn.commit()
            except ConfigError:
                raise
            except Exception as exc:
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
                for secret in self._secrets:  # libpq quotes a badly encoded password back
                    detail = detail.replace(secret, "***")
                raise ConfigError(
                    f"the job store at {self.where} cannot be opened: {type(exc).__name__}: {detail}"
                ) from None

        await asyncio.get_running_loop().run_in_executor(self._executor, setup)

    def _migrate(self, cur: Any) -> bool:
        """Brings a store made by an earlier version up to this schema (in the start-up's
        transaction). True when SQLite's jobs table was set aside, to be copied back once the
        tables are made."""
        if self._dialect.name == "sqlite":
            cur.execute("PRAGMA table_info(gengate_jobs)")
            columns = {row[1] for row in cur.fetchall()}
            if not columns or "owner" in columns:
                return False
            for statement in _SQLITE_SET_ASIDE:
                cur.execute(statement)
            return True
        cur.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = 'gengate_jobs'"
        )
        columns = {row[0] for row in cur.fetchall()}
        if columns and "owner" not in columns:
            for statement in _POSTGRES_ADD_OWNER:
                cur.execute(statement)
        return False

    async def close(self) -> None:
        """Closes the connection and the store's thread; a second close does nothing."""
        if self._closed:  # a server stopped twice
            return
        self._closed = True

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._executor, shut)
        self._executor.shutdown(wait=True)

    # -- jobs -------------------------------------------------------------------------------

    async def create_job(
        self,
        *,
        display_name: str,
        idempotency_key: str,
        options: JobOptions,
        items: Iterable[tuple[bytes | None, ItemResult | None]] = (),
        sealed: bool = True,
        owner: str = "",
    ) -> tuple[Job, bool]:
        """Stores a job of `owner` (the caller creating it; "" without callers) and its first
        items (request bytes, or a result for an item refused at once). Returns (job, created):
        with a key `owner` already used, that job and False (keys are per owner)."""
        job_id = "job-" + uuid.uuid4().hex[:24]
        now = time.time()
        sql = self._sql

        def create(conn: Any) -> tuple[Job, bool]:
            cur = conn.cursor()
            if idempotency_key:
                existing = self._by_key(cur, idempotency_key, owner)
                if existing is not None:
                    return existing, False
            cur.execute(
                sql(
                    "INSERT INTO gengate_jobs (id, display_name, idempotency_key, state, sealed, total, "
                    "offline, priority, max_concurrency, create_time, owner) "
                    "VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?)"
                ),
                (
                    job_id,
                    display_name,
                    idempotency_key or None,
                    JobState.QUEUED.value,
                    int(sealed),
                    int(options.offline),
                    options.priority,
                    options.max_concurrency,
                    now,
                    owner,
                ),
            )
            self._insert_items(cur, job_id, 0, items)
            return self._load(cur, job_id), True

        try:
            return await self._run(create)
        except Exception as exc:
            if idempotency_key and _is_unique_violation(exc):  # another replica created it just now
                existing = await self.find_by_key(idempotency_key, owner)
                if existing is not None:
                    return existing, False
            raise

    async def add_items(
        self, job_id: str, start: int, items: Iterable[tuple[bytes | None, ItemResult | None]]
    ) -> int:
        """Appends items (an upload still in progress) from index `start`; returns the new total."""

        def add(conn: Any) -> int:
            cur = conn.cursor()
            self._insert_items(cur, job_id, start, items)
            return self._load(cur, job_id).total

        return await self._run(add)

    async def seal(self, job_id: str) -> Job:
        """Ends an upload: the job can run."""
        return await self._run(lambda conn: self._update_job(conn.cursor(), job_id, "sealed = 1"))

    def _insert_items(
        self, cur: Any, job_id: str, start: int, items: Iterable[tuple[bytes | None, ItemResult | None]]
    ) -> None:
        sql = self._sql
        pending: list[tuple[Any, ...]] = []
        count = done = failed = 0
        for offset, (request, result) in enumerate(items):
            index = start + offset
            count += 1
            if result is None:
                pending.append((job_id, index, request, None, 0))
            else:
                done += 1
                failed += int(result.failed)
                pending.append((job_id, index, None, result.payload, int(result.failed)))
            if len(pending) >= INSERT_CHUNK:
                cur.executemany(
                    sql(_INSERT_ITEMS),
                    pending,
                )
                pending.clear()
        if pending:
            cur.executemany(
                sql(_INSERT_ITEMS),
                pending,
            )
        cur.execute(
            sql(
                "UPDATE gengate_jobs SET total = total + ?, done = done + ?, failed = failed + ? WHERE id = ?"
            ),
            (count, done, failed, job_id),
        )

    def _load(self, cur: Any, job_id: str, owner: str | None = None) -> Job:
        """The job; NotFound when there is none, or when it is not `owner`'s (None: anyone's),
        alike: a caller never learns that another's job exists."""
        if owner is None:
            cur.execute(self._sql(f"SELECT {_JOB_COLUMNS} FROM gengate_jobs WHERE id = ?"), (job_id,))
        else:
            cur.execute(
                self._sql(f"SELECT {_JOB_COLUMNS} FROM gengate_jobs WHERE id = ? AND owner = ?"),
                (job_id, owner),
            )
        row = cur.fetchone()
        if row is None:
            raise NotFound(
                f"no batch job {job_id[:64]!r}", reason="JOB_NOT_FOUND", metadata={"job": job_id[:64]}
            )
        return _job(row)

    def _update_job(self, cur: Any, job_id: str, assignments: str, *params: Any) -> Job:
        cur.execute(self._sql(f"UPDATE gengate_jobs SET {assignments} WHERE id = ?"), (*params, job_id))
        return self._load(cur, job_id)

    async def get(self, job_id: str, owner: str | None = None) -> Job:
        """The job; NotFound JOB_NOT_FOUND when there is none, or it is not `owner`'s (None: anyone's)."""
        return await self._run(lambda conn: self._load(conn.cursor(), job_id, owner))

    def _by_key(self, cur: Any, key: str, owner: str) -> Job | None:
        cur.execute(
            self._sql(f"SELECT {_JOB_COLUMNS} FROM gengate_jobs WHERE owner = ? AND idempotency_key = ?"),
            (owner, key),
        )
        row = cur.fetchone()
        return None if row is None else _job(row)

    async def find_by_key(self, key: str, owner: str = "") -> Job | None:
        """`owner`'s job created with idempotency key `key`, if any."""
        return await self._run(lambda conn: self._by_key(conn.cursor(), key, owner))

    async def list_jobs(
        self, limit: int, before: tuple[float, str] | None = None, owner: str | None = None
    ) -> list[Job]:
        """Jobs newest first, at most `limit`, created before the (create_time, id) `before`;
        only `owner`'s when given."""
        conditions: list[str] = []
        params: list[Any] = []
        if owner is not None:
            conditions.append("owner = ?")
            params.append(owner)
        if before is not None:
            conditions.append("(create_time < ? OR (create_time = ? AND id < ?))")
            params += [before[0], before[0], before[1]]
        where = f"WHERE {' AND '.join(conditions)} " if conditions else ""
        query = self._sql(
            f"SELECT {_JOB_COLUMNS} FROM gengate_jobs {where}ORDER BY create_time DESC, id DESC LIMIT ?"
        )

        def page(conn: Any) -> list[Job]:
            cur = conn.cursor()
            cur.execute(query, (*params, limit))
            return [_job(row) for row in cur.fetchall()]

        return await self._run(page)

    async def runnable(self) -> list[Job]:
        """Queued or running jobs whose upload is complete, by priority then age."""

        def find(conn: Any) -> list[Job]:
            cur = conn.cursor()
            cur.execute(
                self._sql(
                    f"SELECT {_JOB_COLUMNS} FROM gengate_jobs WHERE state IN (?, ?) AND sealed = 1 "
                    "ORDER BY priority DESC, create_time, id"
                ),
                (JobState.QUEUED.value, JobState.RUNNING.value),
            )
            return [_job(row) for row in cur.fetchall()]

        return await self._run(find)

    async def mark_running(self, job_id: str) -> Job:
        now = time.time()
        return await self._run(
            lambda conn: self._update_job(
                conn.cursor(),
                job_id,
                "state = CASE WHEN state = ? THEN ? ELSE state END, start_time = COALESCE(start_time, ?)",
                JobState.QUEUED.value,
                JobState.RUNNING.value,
                now,
            )
        )

    async def finish_if_complete(self, job_id: str) -> Job:
        """SUCCEEDED once every item has its result (a no-op before, or for a finished job)."""
        now = time.time()
        return await self._run(
            lambda conn: self._update_job(
                conn.cursor(),
                job_id,
                "state = CASE WHEN done >= total AND sealed = 1 AND state IN (?, ?) THEN ? ELSE state END, "
                "end_time = CASE WHEN done >= total AND sealed = 1 AND end_time IS NULL THEN ? "
                "ELSE end_time END",
                JobState.QUEUED.value,
                JobState.RUNNING.value,
                JobState.SUCCEEDED.value,
                now,
            )
        )

    async def fail(self, job_id: str, error: str, cancelled_payload: bytes) -> Job:
        """FAILED with `error`: items without a result get `cancelled_payload` (their status)."""
        return await self._end(job_id, JobState.FAILED, cancelled_payload, error=error)

    async def cancel(self, job_id: str, cancelled_payload: bytes, owner: str | None = None) -> Job:
        """CANCELLED: items without a result get `cancelled_payload`; FailedPrecondition when the
        job has already ended; NotFound when it is not `owner`'s (None: anyone's)."""
        return await self._end(job_id, JobState.CANCELLED, cancelled_payload, owner=owner)

    async def _end(
        self, job_id: str, state: JobState, payload: bytes, *, error: str = "", owner: str | None = None
    ) -> Job:
        sql = self._sql
        now = time.time()

        def finished(job: Job) -> FailedPrecondition:
            return FailedPrecondition(
                f"batch job {job_id} has already ended ({job.state.value})",
                reason="JOB_FINISHED",
                metadata={"job": job_id, "state": job.state.value},
            )

        def end(conn: Any) -> Job:
            cur = conn.cursor()
            job = self._load(cur, job_id, owner)
            if job.state.finished:
                raise finished(job)
            cur.execute(
                sql(
                    "UPDATE gengate_job_items SET result = ?, failed = 1, lease_owner = NULL, "
                    "lease_until = NULL WHERE job_id = ? AND result IS NULL"
                ),
                (payload, job_id),
            )
            ended = cur.rowcount if cur.rowcount is not None and cur.rowcount >= 0 else 0
            cur.execute(
                sql(
                    "UPDATE gengate_jobs SET state = ?, done = done + ?, failed = failed + ?, end_time = ?, "
                    "error = ?, sealed = 1 WHERE id = ? AND state IN (?, ?)"
                ),
                (
                    state.value,
                    ended,
                    ended,
                    now,
                    error,
                    job_id,
                    JobState.QUEUED.value,
                    JobState.RUNNING.value,
                ),
            )
            if cur.rowcount != 1:  # another replica ended it since it was read: theirs stands
                raise finished(self._load(cur, job_id))
            return self._load(cur, job_id)

        return await self._run(end)

    async def set_provider_state(self, job_id: str, state: dict[str, Any]) -> None:
        """Remembers an offline job's provider batch (ids, files) across restarts."""
        await self._run(
            lambda conn: conn.cursor().execute(
                self._sql("UPDATE gengate_jobs SET provider_state = ? WHERE id = ?"),
                (json.dumps(state), job_id),
            )
        )

    async def provider_state(self, job_id: str) -> dict[str, Any] | None:
        def read(conn: Any) -> dict[str, Any] | None:
            cur = conn.cursor()
            cur.execute(self._sql("SELECT provider_state FROM gengate_jobs WHERE id = ?"), (job_id,))
            row = cur.fetchone()
            return None if row is None or row[0] is None else dict(json.loads(row[0]))

        return await self._run(read)

    # -- items ------------------------------------------------------------------------------

    async def lease(self, job_id: str, owner: str, count: int, lease_s: float) -> list[LeasedItem]:
        """Up to `count` items without a result and without a live lease, lowest index first,
        leased to `owner` for `lease_s` seconds."""
        sql = self._sql
        now = time.time()

        def take(conn: Any) -> list[LeasedItem]:
            cur = conn.cursor()
            cur.execute(
                sql(
                    "UPDATE gengate_job_items SET lease_owner = ?, lease_until = ? WHERE (job_id, idx) IN ("
                    "SELECT job_id, idx FROM gengate_job_items WHERE job_id = ? AND result IS NULL AND "
                    "(lease_until IS NULL OR lease_until < ?) ORDER BY idx LIMIT ?"
                    f"{self._dialect.skip_locked}) "
                    "RETURNING idx, request"
                ),
                (owner, now + lease_s, job_id, now, count),
            )
            rows = sorted(cur.fetchall(), key=lambda r: int(r[0]))
            return [LeasedItem(int(idx), bytes(request or b"")) for idx, request in rows]

        return await self._run(take)

    async def renew(self, owner: str, lease_s: float) -> int:
        """Extends every lease `owner` holds; returns how many."""
        now = time.time()

        def renew(conn: Any) -> int:
            cur = conn.cursor()
            cur.execute(
                self._sql(
                    "UPDATE gengate_job_items SET lease_until = ? WHERE lease_owner = ? AND result IS NULL"
                ),
                (now + lease_s, owner),
            )
            return int(cur.rowcount or 0)

        return await self._run(renew)

    async def release(self, job_id: str, owner: str, indices: Sequence[int]) -> None:
        """Gives leased items back unfinished (this runner stops), so another can take them now."""

        def give_back(conn: Any) -> None:
            conn.cursor().executemany(
                self._sql(
                    "UPDATE gengate_job_items SET lease_owner = NULL, lease_until = NULL "
                    "WHERE job_id = ? AND idx = ? AND lease_owner = ? AND result IS NULL"
                ),
                [(job_id, i, owner) for i in indices],
            )

        await self._run(give_back)

    async def release_dead_local(self) -> int:
        """Releases leases held by processes of this host that no longer run (a kill -9)."""
        host = socket.gethostname()

        def sweep(conn: Any) -> int:
            cur = conn.cursor()
            cur.execute(
                self._sql("SELECT DISTINCT lease_owner FROM gengate_job_items WHERE lease_owner LIKE ?"),
                (f"{host}:%",),
            )
            dead = [owner for (owner,) in cur.fetchall() if not _pid_alive(owner)]
            for owner in dead:
                cur.execute(
                    self._sql(
                        "UPDATE gengate_job_items SET lease_owner = NULL, lease_until = NULL "
                        "WHERE lease_owner = ?"
                    ),
                    (owner,),
                )
            return len(dead)

        return await self._run(sweep)

    async def complete(self, job_id: str, result: ItemResult) -> bool:
        """Stores an item's result unless it already has one; False when another runner's result
        came first (this one is dropped: one result per index)."""
        return (await self.complete_many([(job_id, result)]))[0]

    async def complete_many(self, results: Sequence[tuple[str, ItemResult]]) -> list[bool]:
        """`complete` for several items in one transaction (a runner stores what finished
        together at once: one commit instead of one per item)."""
        sql = self._sql
        item_sql = sql(
            "UPDATE gengate_job_items SET result = ?, failed = ?, lease_owner = NULL, "
            "lease_until = NULL, request = NULL WHERE job_id = ? AND idx = ? AND result IS NULL"
        )
        job_sql = sql(
            "UPDATE gengate_jobs SET done = done + ?, failed = failed + ?, "
            "input_tokens = input_tokens + ?, output_tokens = output_tokens + ?, "
            "cached_input_tokens = cached_input_tokens + ? WHERE id = ?"
        )

        def store(conn: Any) -> list[bool]:
            cur = conn.cursor()
            stored: list[bool] = []
            counts: dict[str, list[int]] = {}
            for job_id, result in results:
                cur.execute(item_sql, (result.payload, int(result.failed), job_id, result.index))
                stored.append(cur.rowcount == 1)
                if cur.rowcount == 1:
                    u = result.usage
                    c = counts.setdefault(job_id, [0, 0, 0, 0, 0])
                    for i, value in enumerate(
                        (1, int(result.failed), u.input_tokens, u.output_tokens, u.cached_input_tokens)
                    ):
                        c[i] += value
            for job_id, c in counts.items():
                cur.execute(job_sql, (*c, job_id))
            return stored

        return await self._run(store)

    async def results(self, job_id: str, after: int, limit: int) -> list[tuple[int, ItemResult | None]]:
        """Items after index `after` in index order (at most `limit`), each with its result or None."""

        def read(conn: Any) -> list[tuple[int, ItemResult | None]]:
            cur = conn.cursor()
            cur.execute(
                self._sql(
                    "SELECT idx, result, failed FROM gengate_job_items WHERE job_id = ? AND idx > ? "
                    "ORDER BY idx LIMIT ?"
                ),
                (job_id, after, limit),
            )
            out: list[tuple[int, ItemResult | None]] = []
            for idx, payload, failed in cur.fetchall():
                index = int(idx)
                out.append(
                    (index, None if payload is None else ItemResult(index, bytes(payload), bool(failed)))
                )
            return out

        return await self._run(read)


def _pid_alive(owner: str) -> bool:
    try:
        pid = int(owner.split(":")[1])
    except (IndexError, ValueError):
        return True  # not ours to judge
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_unique_violation(exc: Exception) -> bool:
    if isinstance(exc, sqlite3.IntegrityError):
        return True
    return type(exc).__name__ in ("UniqueViolation", "IntegrityError")


def open_store(url: str, data_dir: Path | None = None) -> JobStore:
    """The store a URL names: `sqlite:///path.db` (relative paths under `data_dir`),
    `postgresql://user@host:port/db`. ConfigError for anything else."""
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        # As SQLAlchemy reads it: sqlite:///jobs.db is relative (to data_dir), sqlite:////abs.db absolute.
        raw = url[len("sqlite:///") :] if url.startswith("sqlite:///") else ""
        if not raw:
            raise ConfigError(
                "server.jobs.store: a SQLite store is sqlite:///relative.db or sqlite:////abs/path.db"
            )
        path = Path(raw)
        if not path.is_absolute():
            path = (data_dir or Path.cwd()) / path

        def connect_sqlite() -> sqlite3.Connection:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(path), check_same_thread=False, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            return conn

        return JobStore(connect_sqlite, _SQLITE, str(path))
    if parsed.scheme in ("postgresql", "postgres"):
        # The hosts as written (libpq takes several, h1:5432,h2:5432), without user or password.
        where = f"postgresql://{parsed.netloc.rpartition('@')[2] or 'localhost'}{parsed.path}"
        query = parse_qs(parsed.query)
        secrets = [parsed.password or "", *query.get("password", [])]
        secrets += [unquote(secret) for secret in secrets]
        # Without a limit libpq waits on an unreachable host for as long as TCP does.
        options: dict[str, Any] = {} if "connect_timeout" in query else {"connect_timeout": 10}

        def connect_postgres() -> Any:
            try:
                import psycopg
            except ImportError as exc:
                raise ConfigError(
                    "a PostgreSQL job store needs psycopg: pip install 'gengate[postgres]'"
                ) from exc
            return psycopg.connect(url, **options)

        return JobStore(connect_postgres, _POSTGRES, where, secrets)
    raise ConfigError(
        f"server.jobs.store must be sqlite:///path.db or postgresql://..., not {url.split(':')[0][:20]!r}"
    )
