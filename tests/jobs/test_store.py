"""The job store, once per database: SQLite in a temp folder and a real PostgreSQL (a fresh
database per test, tests/jobs/postgres.py). Time is a fake clock the tests move, so lease expiry
and list order need no waiting."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import gengate.jobs.store as store_module
import pytest
from gengate.errors import ConfigError, FailedPrecondition, NotFound
from gengate.jobs.model import ItemResult, Job, JobOptions, JobState, JobUsage
from gengate.jobs.store import JobStore, open_store
from postgres import PostgresServer

T = TypeVar("T")
CANCELLED = b"\x08\x01cancelled"
# Payloads with every byte value: BLOB and BYTEA keep them as they are.
PAYLOAD = bytes(range(256))

Items = list[tuple[bytes | None, ItemResult | None]]


class Clock:
    """Stands in for the store's `time` module: `time()` is what the test set."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(store_module, "time", fake)
    return fake


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return str(request.getfixturevalue("postgres_url"))


OpenStore = Callable[[], Awaitable[JobStore]]


@pytest.fixture
async def open_one(store_url: str) -> AsyncIterator[OpenStore]:
    """Opens stores on the test's database (several: replicas sharing it); closes them after."""
    opened: list[JobStore] = []

    async def make() -> JobStore:
        store = open_store(store_url)
        await store.open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


@pytest.fixture
async def store(open_one: OpenStore, clock: Clock) -> JobStore:
    return await open_one()


def requests(n: int) -> Items:
    return [(b"req-%d" % i + PAYLOAD, None) for i in range(n)]


async def new_job(store: JobStore, items: Items, **kw: Any) -> str:
    job, created = await store.create_job(
        display_name=kw.pop("display_name", "j"),
        idempotency_key=kw.pop("idempotency_key", ""),
        options=kw.pop("options", JobOptions()),
        items=items,
        **kw,
    )
    assert created
    return job.id


async def indices(store: JobStore, job_id: str, owner: str, count: int, lease_s: float = 10.0) -> list[int]:
    return [item.index for item in await store.lease(job_id, owner, count, lease_s)]


def ok(index: int, output_tokens: int = 0) -> ItemResult:
    return ItemResult(index, b"ok-%d" % index + PAYLOAD, False, JobUsage(1, output_tokens, 0))


async def test_a_job_keeps_its_items_and_the_results_refused_at_create(store: JobStore) -> None:
    refused = ItemResult(1, b"refused" + PAYLOAD, True)
    job, created = await store.create_job(
        display_name="first",
        idempotency_key="",
        options=JobOptions(offline=True, priority=3, max_concurrency=2),
        items=[(b"r0" + PAYLOAD, None), (None, refused), (b"r2", None)],
    )
    assert created and job.id.startswith("job-")
    assert (job.state, job.total, job.done, job.failed, job.sealed) == (JobState.QUEUED, 3, 1, 1, True)
    assert job.options == JobOptions(offline=True, priority=3, max_concurrency=2)
    assert job.display_name == "first" and job.idempotency_key == "" and job.create_time == 1_000_000.0
    assert job.start_time is None and job.end_time is None and job.error == ""
    assert await store.get(job.id) == job
    rows = await store.results(job.id, -1, 10)
    assert rows == [(0, None), (1, refused), (2, None)]
    assert all(type(r.payload) is bytes for _, r in rows if r is not None)
    leased = await store.lease(job.id, "a", 10, 10.0)
    assert [(i.index, i.request) for i in leased] == [(0, b"r0" + PAYLOAD), (2, b"r2")]
    assert all(type(i.request) is bytes for i in leased)
    with pytest.raises(NotFound) as missing:
        await store.get("job-nope")
    assert missing.value.reason == "JOB_NOT_FOUND"


async def test_an_upload_adds_items_and_runs_once_sealed(store: JobStore) -> None:
    job_id = await new_job(store, requests(2), sealed=False)
    assert await store.runnable() == []
    assert await store.add_items(job_id, 2, [(b"more", None), (None, ItemResult(3, b"no", True))]) == 4
    assert await store.runnable() == []
    sealed = await store.seal(job_id)
    assert (sealed.sealed, sealed.total, sealed.done, sealed.failed) == (True, 4, 1, 1)
    assert [j.id for j in await store.runnable()] == [job_id]
    assert await indices(store, job_id, "a", 10) == [0, 1, 2]


async def test_a_large_job_is_inserted_in_chunks(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "INSERT_CHUNK", 7)
    items = requests(30)
    items[11] = (None, ItemResult(11, b"refused", True))
    job_id = await new_job(store, items)
    job = await store.get(job_id)
    assert (job.total, job.done, job.failed) == (30, 1, 1)
    rows = await store.results(job_id, -1, 100)
    assert [i for i, _ in rows] == list(range(30)) and [i for i, r in rows if r] == [11]


async def test_a_key_already_used_returns_that_job(store: JobStore) -> None:
    first, created = await store.create_job(
        display_name="a", idempotency_key="k", options=JobOptions(), items=requests(1)
    )
    again, created_again = await store.create_job(
        display_name="b", idempotency_key="k", options=JobOptions(), items=requests(3)
    )
    assert created and not created_again and again == first and again.total == 1
    assert await store.find_by_key("k") == first and await store.find_by_key("other") is None
    other = await new_job(store, requests(1), idempotency_key="other")
    assert other != first.id and {j.id for j in await store.list_jobs(10)} == {first.id, other}


async def test_a_job_is_seen_only_by_its_owner_and_keys_are_per_owner(store: JobStore, clock: Clock) -> None:
    """An owner's reads (get, list, cancel) see its own jobs only; another's is NOT_FOUND as an
    unknown id is. No owner given (no callers configured) sees every job."""
    a1 = await new_job(store, requests(2), owner="team-a", idempotency_key="k")
    clock.now += 1
    b1 = await new_job(store, requests(1), owner="team-b", idempotency_key="k")  # the same key: its own job
    clock.now += 1
    a2 = await new_job(store, requests(1), owner="team-a")
    assert (await store.get(a1, "team-a")).owner == "team-a" and (await store.get(b1)).owner == "team-b"
    again, created = await store.create_job(
        display_name="x", idempotency_key="k", options=JobOptions(), items=requests(5), owner="team-b"
    )
    assert not created and again.id == b1
    assert await store.find_by_key("k", "team-a") == await store.get(a1)
    assert await store.find_by_key("k") is None  # no owner's job has it
    for missing in (b1, "job-nope"):
        for read in (store.get(missing, "team-a"), store.cancel(missing, CANCELLED, "team-a")):
            with pytest.raises(NotFound) as caught:
                await read
            assert caught.value.reason == "JOB_NOT_FOUND" and caught.value.metadata == {"job": missing}
    assert (await store.get(b1)).state == JobState.QUEUED  # the other's cancel changed nothing
    assert [j.id for j in await store.list_jobs(10, owner="team-a")] == [a2, a1]
    first = await store.list_jobs(1, owner="team-a")
    after = await store.list_jobs(5, (first[0].create_time, first[0].id), owner="team-a")
    assert [j.id for j in first + after] == [a2, a1]  # pages never reach into another's jobs
    assert [j.id for j in await store.list_jobs(10, owner="team-c")] == []
    assert [j.id for j in await store.list_jobs(10)] == [a2, b1, a1]
    assert (await store.cancel(a1, CANCELLED, "team-a")).state == JobState.CANCELLED


@contextlib.contextmanager
def interleaved(
    store: JobStore, before: str, other: Callable[[], Coroutine[Any, Any, T]]
) -> Iterator[list[T]]:
    """While inside, the first statement of `store` that starts with `before` waits for
    `other()` (another replica's call) to run to its end first: a race, made to happen."""
    loop = asyncio.get_running_loop()
    happened: list[T] = []
    real = store._conn

    class Cursor:
        def __init__(self) -> None:
            self.inner = real.cursor()

        def execute(self, sql: str, params: Any = ()) -> Any:
            if sql.startswith(before) and not happened:  # on the store's thread: the loop is free
                happened.append(asyncio.run_coroutine_threadsafe(other(), loop).result())
            return self.inner.execute(sql, params)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    class Connection:
        def cursor(self) -> Cursor:
            return Cursor()

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    store._conn = Connection()
    try:
        yield happened
    finally:
        store._conn = real
    assert happened, f"no statement started with {before!r}"


async def test_two_replicas_creating_with_one_key_make_one_job(open_one: OpenStore, clock: Clock) -> None:
    """Replica 1 looks the key up and finds nothing, replica 2 creates the job, then replica 1's
    insert meets the unique key and answers with replica 2's job."""
    one, two = await open_one(), await open_one()

    async def theirs() -> tuple[Job, bool]:
        return await two.create_job(
            display_name="two", idempotency_key="k", options=JobOptions(), items=requests(2)
        )

    with interleaved(one, "INSERT INTO gengate_jobs ", theirs) as raced:
        job, created = await one.create_job(
            display_name="one", idempotency_key="k", options=JobOptions(), items=requests(5)
        )
    [(their_job, they_created)] = raced
    assert they_created and not created and job == their_job and job.display_name == "two" and job.total == 2
    assert [j.id for j in await one.list_jobs(10)] == [job.id]
    assert len(await one.results(job.id, -1, 10)) == 2  # replica 1's items went with its insert


async def test_concurrent_creates_with_one_key_make_one_job_per_key(open_one: OpenStore) -> None:
    stores = [await open_one() for _ in range(3)]
    keys = [f"key-{n}" for n in range(8)]
    made = await asyncio.gather(
        *(
            s.create_job(display_name=s.where, idempotency_key=key, options=JobOptions(), items=requests(2))
            for key in keys
            for s in stores
        )
    )
    by_key: dict[str, set[str]] = {}
    for job, _ in made:
        by_key.setdefault(job.idempotency_key, set()).add(job.id)
    assert all(len(ids) == 1 for ids in by_key.values()) and sorted(by_key) == keys
    assert sum(created for _, created in made) == len(keys)
    assert len(await stores[0].list_jobs(100)) == len(keys)


async def test_leases_go_lowest_index_first_and_an_expired_one_to_another_owner(
    store: JobStore, clock: Clock
) -> None:
    job_id = await new_job(store, requests(5))
    assert await indices(store, job_id, "a", 2) == [0, 1]
    assert await indices(store, job_id, "b", 2) == [2, 3]
    assert await indices(store, job_id, "c", 9) == [4]
    assert await indices(store, job_id, "d", 9) == []
    clock.now += 5
    assert await store.renew("a", 10.0) == 2  # a's leases now end at +15, the others' at +10
    clock.now += 6
    assert await indices(store, job_id, "d", 9) == [2, 3, 4]  # b's and c's expired
    assert await indices(store, job_id, "e", 9) == []
    clock.now += 5
    assert await indices(store, job_id, "e", 1) == [0]
    assert await store.renew("nobody", 10.0) == 0


async def test_renew_counts_only_unfinished_leases(store: JobStore, clock: Clock) -> None:
    job_id = await new_job(store, requests(3))
    assert await indices(store, job_id, "a", 3) == [0, 1, 2]
    assert await store.complete(job_id, ok(1))
    assert await store.renew("a", 10.0) == 2


async def test_released_items_go_to_the_next_lease_at_once(store: JobStore) -> None:
    job_id = await new_job(store, requests(4))
    assert await indices(store, job_id, "a", 3) == [0, 1, 2]
    await store.release(job_id, "b", [0, 1])  # not b's: nothing happens
    assert await indices(store, job_id, "b", 9) == [3]
    await store.release(job_id, "a", [0, 2])
    assert await indices(store, job_id, "c", 9) == [0, 2]
    await store.release(job_id, "a", [])


async def test_concurrent_leases_share_the_items_without_overlap(open_one: OpenStore) -> None:
    stores = [await open_one() for _ in range(3)]
    job_id = await new_job(stores[0], requests(60))

    async def drain(store: JobStore, owner: str) -> list[int]:
        taken: list[int] = []
        while batch := await indices(store, job_id, owner, 3):
            taken += batch
        return taken

    taken = await asyncio.gather(*(drain(s, f"owner-{n}") for n, s in enumerate(stores)))
    every = [i for batch in taken for i in batch]
    assert sorted(every) == list(range(60))  # each index leased once


async def test_an_item_is_completed_once(store: JobStore) -> None:
    job_id = await new_job(store, requests(3))
    await indices(store, job_id, "a", 3)
    assert await store.complete(job_id, ok(0, output_tokens=5))
    assert await store.complete(job_id, ItemResult(1, b"bad", True, JobUsage(2, 0, 1)))
    before = await store.get(job_id)
    assert (before.done, before.failed, before.usage) == (2, 1, JobUsage(3, 5, 1))
    assert not await store.complete(job_id, ok(0, output_tokens=7))  # a second result: dropped
    assert not await store.complete(job_id, ItemResult(1, b"again", False))
    assert await store.get(job_id) == before
    rows = dict(await store.results(job_id, -1, 10))
    assert rows[0] == ItemResult(0, ok(0).payload, False) and rows[1] == ItemResult(1, b"bad", True)
    assert rows[2] is None
    assert not await store.complete("job-nope", ok(0))


async def test_two_replicas_completing_one_index_store_one_result(open_one: OpenStore) -> None:
    stores = [await open_one() for _ in range(4)]
    job_id = await new_job(stores[0], requests(10))
    outcomes = await asyncio.gather(
        *(s.complete(job_id, ok(i, output_tokens=n + 1)) for i in range(10) for n, s in enumerate(stores))
    )
    assert sum(outcomes) == 10
    job = await stores[0].get(job_id)
    assert (job.done, job.failed, job.usage.input_tokens) == (10, 0, 10)


async def test_results_page_in_index_order(store: JobStore) -> None:
    job_id = await new_job(store, requests(7))
    for i in (0, 1, 2, 4, 6):
        assert await store.complete(job_id, ok(i))
    pages = [await store.results(job_id, after, 3) for after in (-1, 2, 5, 6)]
    assert [[i for i, _ in page] for page in pages] == [[0, 1, 2], [3, 4, 5], [6], []]
    assert [r is None for _, r in pages[1]] == [True, False, True]
    assert pages[0][1][1] == ItemResult(1, ok(1).payload, False)


async def test_a_job_runs_then_succeeds_once_every_item_has_a_result(store: JobStore, clock: Clock) -> None:
    job_id = await new_job(store, requests(2))
    clock.now += 1
    running = await store.mark_running(job_id)
    assert (running.state, running.start_time) == (JobState.RUNNING, 1_000_001.0)
    clock.now += 1
    assert (await store.mark_running(job_id)).start_time == 1_000_001.0  # the first start stays
    assert await store.complete(job_id, ok(0))
    assert (await store.finish_if_complete(job_id)).state == JobState.RUNNING
    assert await store.complete(job_id, ok(1))
    clock.now += 1
    done = await store.finish_if_complete(job_id)
    assert (done.state, done.end_time, done.done) == (JobState.SUCCEEDED, 1_000_003.0, 2)
    clock.now += 1
    assert await store.finish_if_complete(job_id) == done
    assert await store.runnable() == []


async def test_runnable_jobs_come_by_priority_then_age(store: JobStore, clock: Clock) -> None:
    low = await new_job(store, requests(1))
    clock.now += 1
    high = await new_job(store, requests(1), options=JobOptions(priority=5))
    clock.now += 1
    later = await new_job(store, requests(1))
    assert [j.id for j in await store.runnable()] == [high, low, later]


@pytest.mark.parametrize("end", ["cancel", "fail"])
async def test_ending_a_job_gives_every_unfinished_item_the_cancelled_status(
    store: JobStore, clock: Clock, end: str
) -> None:
    items = requests(5)
    items[4] = (None, ItemResult(4, b"refused", True))
    job_id = await new_job(store, items, sealed=False)
    await indices(store, job_id, "a", 2)
    assert await store.complete(job_id, ok(0))
    clock.now += 1
    if end == "cancel":
        ended = await store.cancel(job_id, CANCELLED)
        assert (ended.state, ended.error) == (JobState.CANCELLED, "")
    else:
        ended = await store.fail(job_id, "the upload was interrupted", CANCELLED)
        assert (ended.state, ended.error) == (JobState.FAILED, "the upload was interrupted")
    assert (ended.total, ended.done, ended.failed, ended.end_time, ended.sealed) == (
        5,
        5,
        4,
        1_000_001.0,
        True,
    )
    rows = await store.results(job_id, -1, 10)
    assert [r for _, r in rows] == [
        ItemResult(0, ok(0).payload, False),
        *(ItemResult(i, CANCELLED, True) for i in (1, 2, 3)),
        ItemResult(4, b"refused", True),
    ]
    assert not await store.complete(job_id, ok(1))  # a runner still on item 1: dropped
    assert await indices(store, job_id, "b", 9) == [] and await store.renew("a", 10.0) == 0
    for again in (store.cancel(job_id, CANCELLED), store.fail(job_id, "x", CANCELLED)):
        with pytest.raises(FailedPrecondition) as finished:
            await again
        assert finished.value.reason == "JOB_FINISHED"
    assert await store.get(job_id) == ended
    with pytest.raises(NotFound):
        await store.cancel("job-nope", CANCELLED)


async def test_a_succeeded_job_cannot_be_cancelled(store: JobStore) -> None:
    job_id = await new_job(store, requests(1))
    assert await store.complete(job_id, ok(0))
    await store.finish_if_complete(job_id)
    with pytest.raises(FailedPrecondition):
        await store.cancel(job_id, CANCELLED)
    assert (await store.get(job_id)).state == JobState.SUCCEEDED


async def test_a_cancel_racing_another_replicas_finish_leaves_the_job_succeeded(
    open_one: OpenStore,
) -> None:
    one, two = await open_one(), await open_one()
    job_id = await new_job(one, requests(2))
    for i in range(2):
        assert await one.complete(job_id, ok(i))
    with interleaved(one, "UPDATE gengate_job_items SET result", lambda: two.finish_if_complete(job_id)):
        with pytest.raises(FailedPrecondition) as late:  # read RUNNING, then the other replica finished it
            await one.cancel(job_id, CANCELLED)
    assert late.value.reason == "JOB_FINISHED" and "succeeded" in str(late.value)
    job = await one.get(job_id)
    assert (job.state, job.done, job.failed) == (JobState.SUCCEEDED, 2, 0)


async def test_two_replicas_cancelling_together_end_the_job_once(open_one: OpenStore) -> None:
    one, two = await open_one(), await open_one()
    job_id = await new_job(one, requests(3))
    with interleaved(one, "UPDATE gengate_job_items SET result", lambda: two.cancel(job_id, b"theirs")):
        with pytest.raises(FailedPrecondition):
            await one.cancel(job_id, CANCELLED)
    job = await one.get(job_id)
    assert (job.state, job.done, job.failed) == (JobState.CANCELLED, 3, 3)
    assert {r.payload for _, r in await one.results(job_id, -1, 10) if r} == {b"theirs"}


async def test_replicas_starting_together_create_the_tables_once(store_url: str) -> None:
    stores = [open_store(store_url) for _ in range(6)]  # on a database without the tables yet
    try:
        await asyncio.gather(*(s.open() for s in stores))
        job_id = await new_job(stores[0], requests(1))
        for s in stores:
            assert [j.id for j in await s.runnable()] == [job_id]
    finally:
        for s in stores:
            await s.close()


async def test_list_pages_newest_first(store: JobStore, clock: Clock) -> None:
    made = []
    for n in range(7):
        made.append(await new_job(store, requests(1)))
        if n != 2:  # jobs 2 and 3 share a create time: the id orders them
            clock.now += 1.5
    newest_first = [made[6], made[5], made[4], *sorted(made[2:4], reverse=True), made[1], made[0]]
    seen: list[str] = []
    before: tuple[float, str] | None = None
    while page := await store.list_jobs(3, before):
        assert len(page) <= 3
        seen += [j.id for j in page]
        before = (page[-1].create_time, page[-1].id)
    assert seen == newest_first


async def test_a_dead_local_runners_leases_are_released(store: JobStore) -> None:
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that ran here and no longer does
    job_id = await new_job(store, requests(6))
    owners = {
        "dead": f"{host}:{dead.pid}:aaaa",
        "me": f"{host}:{os.getpid()}:bbbb",
        "elsewhere": f"other-host-{host}:{dead.pid}:cccc",  # another host's: never judged here
    }
    assert await indices(store, job_id, owners["dead"], 2) == [0, 1]
    assert await indices(store, job_id, owners["me"], 2) == [2, 3]
    assert await indices(store, job_id, owners["elsewhere"], 1) == [4]
    assert await store.release_dead_local() == 1
    assert await indices(store, job_id, "next", 9) == [0, 1, 5]
    assert await store.release_dead_local() == 0


async def test_provider_state_round_trips(store: JobStore) -> None:
    job_id = await new_job(store, requests(1), options=JobOptions(offline=True))
    assert await store.provider_state(job_id) is None
    await store.set_provider_state(job_id, {"batch": "b-1", "files": ["f1", "f2"], "n": 2})
    assert await store.provider_state(job_id) == {"batch": "b-1", "files": ["f1", "f2"], "n": 2}


def test_a_postgres_store_names_its_host_never_its_password() -> None:
    store = open_store("postgresql://user:s3cret-pw@db.example:6543/jobs?sslmode=disable")
    assert store.where == "postgresql://db.example:6543/jobs"


def closed_port() -> int:
    with socket.socket() as sock:  # a port nothing listens on once this returns
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("netloc", "secret"),
    [
        ("user:s3cret-pw@127.0.0.1:{port}", "s3cret-pw"),
        ("user:ab%zzcd@127.0.0.1:{port}", "ab%zzcd"),  # libpq quotes a bad %-escape back
        ("user:s3cret-pw@127.0.0.1:notaport", "s3cret-pw"),
        ("user@127.0.0.1:{port},127.0.0.1:{port}", ""),  # libpq's several hosts
    ],
)
async def test_a_postgres_store_that_cannot_be_opened_is_one_config_error(netloc: str, secret: str) -> None:
    pytest.importorskip("psycopg")
    hosts = netloc.format(port=closed_port())
    store = open_store(f"postgresql://{hosts}/jobs?application_name=gengate-test")
    with pytest.raises(ConfigError) as failed:
        await store.open()
    message = str(failed.value)
    assert message.startswith(f"the job store at postgresql://{hosts.split('@')[1]}/jobs cannot be opened: ")
    assert "\n" not in message and "user" not in message.split(":")[0]
    if secret:
        assert secret not in message and secret[2:] not in message
    await store.close()


async def test_a_store_connects_again_after_the_server_cut_its_connection(
    postgres_url: str, postgres_server: PostgresServer
) -> None:
    store = open_store(postgres_url)
    await store.open()
    try:
        job_id = await new_job(store, requests(2))
        cut = (
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert postgres_server.execute(postgres_url, cut) == [(True,)]
        with pytest.raises(Exception) as lost:  # the call that finds out fails: it may have run or not
            await store.get(job_id)
        assert type(lost.value).__module__.startswith("psycopg")
        assert (await store.get(job_id)).total == 2  # the next one connects again
        assert await indices(store, job_id, "a", 9) == [0, 1]
    finally:
        await store.close()
