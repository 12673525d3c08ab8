"""Replicas sharing one PostgreSQL job store: two servers work through one job together, each
index ends with exactly one result, and when one replica is killed (-9) mid-job its leased items
expire and go to the other, which finishes the job."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import jobs_pb2 as j
from gengate_proto.v1 import jobs_pb2_grpc
from observe import ServerFactory, until
from postgres import PostgresServer
from serve_process import ServerProcess

ITEMS = 40
TOKENS = 4  # "a b c d" at 40 tokens/s: each item runs ~0.1 s


def config(store: str, **jobs: Any) -> dict[str, Any]:
    return {
        "models": [{"name": "slow", "backend": "scripted", "text": "a b c d", "tokens_per_s": 40}],
        "server": {"jobs": {"store": store, "concurrency": 2, "poll_s": 0.05, **jobs}},
    }


@asynccontextmanager
async def jobs_stub(address: str) -> AsyncIterator[jobs_pb2_grpc.BatchJobServiceStub]:
    async with grpc.aio.insecure_channel(address) as channel:
        yield jobs_pb2_grpc.BatchJobServiceStub(channel)


async def create(stub: jobs_pb2_grpc.BatchJobServiceStub) -> str:
    requests = [g.GenerateRequest(model="slow", prompt=f"p{i}") for i in range(ITEMS)]
    return str((await stub.CreateBatchJob(j.CreateBatchJobRequest(requests=requests))).job.id)


async def finish(stub: jobs_pb2_grpc.BatchJobServiceStub, job_id: str) -> j.BatchJob:
    """Follows the job's results to its end; checks one result per index, none twice."""
    request = j.StreamBatchJobResultsRequest(id=job_id, follow=True)
    items = [item async for item in stub.StreamBatchJobResults(request)]
    assert [item.index for item in items] == list(range(ITEMS))
    assert all(item.response.generations[0].text == "a b c d" for item in items)
    job = (await stub.GetBatchJob(j.GetBatchJobRequest(id=job_id))).job
    assert (job.state, job.total, job.done, job.failed) == (j.BATCH_JOB_STATE_SUCCEEDED, ITEMS, ITEMS, 0)
    assert job.usage.output_tokens == TOKENS * ITEMS  # no item counted twice
    return job


def stored(postgres: PostgresServer, url: str) -> tuple[int, int, int]:
    """(items, items with a result, items still leased) in the store."""
    [row] = postgres.execute(url, "SELECT COUNT(*), COUNT(result), COUNT(lease_owner) FROM gengate_job_items")
    return int(row[0]), int(row[1]), int(row[2])


async def test_two_replicas_share_a_job_with_one_result_per_index(
    make_server: ServerFactory, postgres_server: PostgresServer, postgres_url: str
) -> None:
    one = await make_server(config(postgres_url))
    two = await make_server(config(postgres_url))
    assert one.jobs is not None and two.jobs is not None and one.jobs.owner != two.jobs.owner
    async with jobs_stub(one.address) as first, jobs_stub(two.address) as second:
        job_id = await create(first)  # created on one replica, followed on the other
        await finish(second, job_id)
    assert one.jobs.finished_items > 0 and two.jobs.finished_items > 0  # both ran items
    assert one.jobs.finished_items + two.jobs.finished_items == ITEMS  # each stored once
    assert stored(postgres_server, postgres_url) == (ITEMS, ITEMS, 0)


async def test_a_killed_replicas_items_go_to_the_other_when_their_leases_expire(
    make_server: ServerFactory, postgres_server: PostgresServer, postgres_url: str
) -> None:
    """Replica two is `gengate serve` in its own process and is killed -9 while it holds
    leases; replica one, running all along, takes them once they expire (lease_s 1) and ends
    the job. Replica one never sweeps the dead one's leases (that happens at a start only)."""
    cfg = config(postgres_url, lease_s=1.0)
    two = await asyncio.to_thread(ServerProcess, cfg)
    try:
        one = await make_server(cfg)
        assert one.jobs is not None
        leases_of_two = (
            "SELECT COUNT(*) FROM gengate_job_items WHERE lease_owner LIKE %s AND result IS NULL",
            (f"{socket.gethostname()}:{two.proc.pid}:%",),
        )
        async with jobs_stub(two.address) as stub:
            job_id = await create(stub)  # replica two wakes at once and leases first

            def two_is_working() -> bool:
                _, results, _ = stored(postgres_server, postgres_url)
                return results >= 2 and postgres_server.execute(postgres_url, *leases_of_two)[0][0] > 0

            await until(two_is_working, "replica two stored results and holds leases")
    finally:
        two.kill()
    [(held,)] = postgres_server.execute(postgres_url, *leases_of_two)
    _, results_at_kill, _ = stored(postgres_server, postgres_url)
    assert held > 0 and results_at_kill < ITEMS  # killed mid-job, holding leases
    async with jobs_stub(one.address) as stub:
        await finish(stub, job_id)
    assert one.jobs.finished_items >= held  # two's leased items: none but replica one could end them
    assert stored(postgres_server, postgres_url) == (ITEMS, ITEMS, 0)
