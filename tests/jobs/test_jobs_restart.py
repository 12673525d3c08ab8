"""A job survives `kill -9` of the server: `gengate serve` in its own process is killed while
items run, a new one on the same store finishes the job, and every index ends with exactly one
result: none lost, none twice, the counters equal to the items."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import grpc
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import jobs_pb2 as j
from gengate_proto.v1 import jobs_pb2_grpc
from serve_process import ServerProcess

ITEMS = 40
CONFIG = {
    # 8 tokens at 40 tokens/s: each item runs ~0.2 s, four at a time
    "models": [{"name": "slow", "backend": "scripted", "text": "a b c d e f g h", "tokens_per_s": 40}],
    "server": {"jobs": {"concurrency": 4, "poll_s": 0.1}},
}


def _stub(address: str) -> tuple[grpc.Channel, jobs_pb2_grpc.BatchJobServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, jobs_pb2_grpc.BatchJobServiceStub(channel)


def _job(stub: jobs_pb2_grpc.BatchJobServiceStub, job_id: str) -> j.BatchJob:
    return stub.GetBatchJob(j.GetBatchJobRequest(id=job_id)).job


def _leased(data_dir: Path) -> int:
    """Items the store shows under a lease right now (read beside the running server)."""
    with sqlite3.connect(data_dir / "jobs.db", timeout=5) as db:
        (leased,) = db.execute(
            "SELECT COUNT(*) FROM gengate_job_items WHERE lease_owner IS NOT NULL"
        ).fetchone()
    return int(leased)


def test_a_killed_server_resumes_the_job_with_one_result_per_item(tmp_path: Path) -> None:
    env = {"GENGATE_DATA_DIR": str(tmp_path)}
    first = ServerProcess(CONFIG, env=env)
    channel, stub = _stub(first.address)
    requests = [g.GenerateRequest(model="slow", prompt=f"p{i}") for i in range(ITEMS)]
    job_id = stub.CreateBatchJob(j.CreateBatchJobRequest(requests=requests)).job.id
    # Some finished, others in flight. Items finish in lockstep (four at a time, eight leased
    # ahead), so `done` alone can land in the instant between one lease and the next: the kill
    # waits until the store also shows leases held, which then last another item's run.
    while (done := _job(stub, job_id).done) < ITEMS and (done < 6 or _leased(tmp_path) == 0):
        time.sleep(0.02)
    first.kill()
    channel.close()
    with sqlite3.connect(tmp_path / "jobs.db") as db:
        (stored_before,) = db.execute(
            "SELECT COUNT(*) FROM gengate_job_items WHERE result IS NOT NULL"
        ).fetchone()
    leased = _leased(tmp_path)
    assert 6 <= stored_before < ITEMS and leased > 0  # killed mid-job, holding leases

    second = ServerProcess(CONFIG, env=env)
    try:
        channel, stub = _stub(second.address)
        items = list(stub.StreamBatchJobResults(j.StreamBatchJobResultsRequest(id=job_id, follow=True)))
        job = _job(stub, job_id)
        channel.close()
    finally:
        second.stop()
    assert [item.index for item in items] == list(range(ITEMS))
    assert all(item.response.generations[0].text == "a b c d e f g h" for item in items)
    assert (job.state, job.done, job.failed, job.total) == (j.BATCH_JOB_STATE_SUCCEEDED, ITEMS, 0, ITEMS)
    assert job.usage.output_tokens == 8 * ITEMS  # no item counted twice
    with sqlite3.connect(tmp_path / "jobs.db") as db:
        rows = db.execute(
            "SELECT COUNT(*), COUNT(result), COUNT(lease_owner) FROM gengate_job_items"
        ).fetchone()
    assert rows == (ITEMS, ITEMS, 0)
