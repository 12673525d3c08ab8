"""Batch jobs belong to the caller who created them, on SQLite and PostgreSQL: each caller lists,
reads, cancels and streams only its own jobs (another's id is NOT_FOUND exactly as an unknown
one), idempotency keys are per caller, and a job's items run as their owner: counted in its
metrics, checked against its models when they run, never charged to its quotas. Without callers
every job is everyone's, as before owners."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from gengate.jobs.model import ItemResult, JobOptions
from gengate.jobs.store import open_store
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc, jobs_pb2_grpc
from gengate_proto.v1 import jobs_pb2 as j
from google.rpc import status_pb2
from metrics_scrape import scrape
from observe import ServerFactory, reason, status_of, until

TOKEN_A = "owner-a-token-4Fh8Qz2Lw"
TOKEN_B = "owner-b-token-9Kd3Xs7Pm"
PRICE = {"input_per_million": 2.0, "output_per_million": 10.0}
MODELS: list[dict[str, Any]] = [
    {"name": "echo", "backend": "scripted"},
    {"name": "gpt", "backend": "scripted", "text": "five six"},
    {
        "name": "slow",
        "backend": "scripted",
        "text": " ".join(f"w{i}" for i in range(400)),
        "tokens_per_s": 40,
    },
]
CALLERS: list[dict[str, Any]] = [
    {"name": "team-a", "token_env": "OWNER_A_TOKEN"},
    {"name": "team-b", "token_env": "OWNER_B_TOKEN"},
]
Stub = jobs_pb2_grpc.BatchJobServiceStub


@pytest.fixture(autouse=True)
def tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OWNER_A_TOKEN", TOKEN_A)
    monkeypatch.setenv("OWNER_B_TOKEN", TOKEN_B)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return str(request.getfixturevalue("postgres_url"))


def config(store: str, callers: list[dict[str, Any]] | None = CALLERS, **server: Any) -> dict[str, Any]:
    jobs = {"store": store, "concurrency": 4, "poll_s": 0.05}
    metrics = {"port": 0, "prices": {"echo": PRICE}}
    return {
        "models": MODELS,
        **({"callers": callers} if callers else {}),
        "server": {"jobs": jobs, "metrics": metrics, **server},
    }


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def create(jobs: Stub, token: str, *prompts: str, model: str = "echo", key: str = "") -> str:
    requests = [g.GenerateRequest(model=model, prompt=p) for p in prompts or ("hi",)]
    reply = await jobs.CreateBatchJob(
        j.CreateBatchJobRequest(requests=requests, idempotency_key=key), metadata=bearer(token)
    )
    return str(reply.job.id)


async def listed(jobs: Stub, token: str | None, page_size: int) -> list[str]:
    """Every job the caller's List shows, page after page (no id twice)."""
    ids: list[str] = []
    page_token = ""
    while True:
        page = await jobs.ListBatchJobs(
            j.ListBatchJobsRequest(page_size=page_size, page_token=page_token),
            metadata=bearer(token) if token else None,
        )
        assert len(page.jobs) <= page_size
        ids += [job.id for job in page.jobs]
        page_token = page.next_page_token
        if not page_token:
            assert len(ids) == len(set(ids))
            return ids


async def results(jobs: Stub, token: str | None, job_id: str) -> list[j.StreamBatchJobResultsResponse]:
    request = j.StreamBatchJobResultsRequest(id=job_id, follow=True)
    metadata = bearer(token) if token else None
    return [item async for item in jobs.StreamBatchJobResults(request, metadata=metadata)]


async def refusal(jobs: Stub, token: str, job_id: str, call: str) -> grpc.aio.AioRpcError:
    """The error a caller gets for `call` on `job_id`."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if call == "get":
            await jobs.GetBatchJob(j.GetBatchJobRequest(id=job_id), metadata=bearer(token))
        elif call == "cancel":
            await jobs.CancelBatchJob(j.CancelBatchJobRequest(id=job_id), metadata=bearer(token))
        else:
            await results(jobs, token, job_id)
    return caught.value


async def test_each_caller_sees_lists_and_cancels_only_its_own_jobs(
    make_server: ServerFactory, store_url: str
) -> None:
    server = await make_server(config(store_url))
    async with grpc.aio.insecure_channel(server.address) as channel:
        jobs = Stub(channel)
        mine = [await create(jobs, TOKEN_A, f"a{n}") for n in range(3)]
        theirs = [await create(jobs, TOKEN_B, f"b{n}", model="slow") for n in range(2)]
        assert set(await listed(jobs, TOKEN_A, page_size=2)) == set(mine)
        assert len(await listed(jobs, TOKEN_A, page_size=2)) == 3
        assert set(await listed(jobs, TOKEN_B, page_size=1)) == set(theirs)
        unknown = "job-" + "0" * (len(theirs[0]) - 4)  # as long as a real id: statuses compare whole
        for call in ("get", "cancel", "results"):
            other = await refusal(jobs, TOKEN_A, theirs[0], call)
            nothing = await refusal(jobs, TOKEN_A, unknown, call)
            assert other.code() == nothing.code() == grpc.StatusCode.NOT_FOUND
            assert reason(other) == "JOB_NOT_FOUND"
            assert other.details().replace(theirs[0], unknown) == nothing.details()
            seen = status_of(other).SerializeToString().replace(theirs[0].encode(), unknown.encode())
            assert seen == status_of(nothing).SerializeToString()  # no detail tells them apart
        job = (await jobs.GetBatchJob(j.GetBatchJobRequest(id=theirs[0]), metadata=bearer(TOKEN_B))).job
        assert job.state != j.BATCH_JOB_STATE_CANCELLED  # the other caller's cancel did nothing
        cancelled = await jobs.CancelBatchJob(j.CancelBatchJobRequest(id=theirs[0]), metadata=bearer(TOKEN_B))
        assert cancelled.job.state == j.BATCH_JOB_STATE_CANCELLED
        await jobs.CancelBatchJob(j.CancelBatchJobRequest(id=theirs[1]), metadata=bearer(TOKEN_B))
        for job_id in mine:
            items = await results(jobs, TOKEN_A, job_id)
            assert len(items) == 1 and items[0].response.generations[0].text.startswith("a")


async def test_an_idempotency_key_is_each_callers_own(make_server: ServerFactory, store_url: str) -> None:
    server = await make_server(config(store_url))
    async with grpc.aio.insecure_channel(server.address) as channel:
        jobs = Stub(channel)
        first_a = await create(jobs, TOKEN_A, "x", key="k")
        first_b = await create(jobs, TOKEN_B, "x", key="k")
        assert first_a != first_b
        assert await create(jobs, TOKEN_A, "y", "z", key="k") == first_a
        assert await create(jobs, TOKEN_B, "y", key="k") == first_b

        async def upload() -> AsyncIterator[j.UploadBatchJobRequest]:
            yield j.UploadBatchJobRequest(header=j.BatchJobHeader(idempotency_key="k"))
            yield j.UploadBatchJobRequest(request=g.GenerateRequest(model="echo", prompt="u"))

        uploaded = await jobs.UploadBatchJob(upload(), metadata=bearer(TOKEN_B))
        assert uploaded.job.id == first_b  # a retried upload: the caller's own job with that key
        assert await listed(jobs, TOKEN_A, page_size=10) == [first_a]
        assert await listed(jobs, TOKEN_B, page_size=10) == [first_b]


async def test_job_items_count_for_their_owner_but_not_against_its_quotas(
    make_server: ServerFactory, store_url: str
) -> None:
    """team-a's job holds more items in flight than its max_concurrency and runs more items than
    its requests_per_minute, and it can still call; metrics show the items under team-a."""
    limited = [{**CALLERS[0], "requests_per_minute": 2, "max_concurrency": 1}, CALLERS[1]]
    server = await make_server(config(store_url, limited))
    runner = server.jobs
    assert runner is not None
    async with grpc.aio.insecure_channel(server.address) as channel:
        jobs, calls = Stub(channel), generation_pb2_grpc.GenerationServiceStub(channel)
        slow = await create(jobs, TOKEN_A, "s1", "s2", model="slow")
        await until(lambda: runner.in_flight == 2, "both of the slow job's items run")
        replies = [
            await calls.Generate(g.GenerateRequest(model="echo", prompt="now"), metadata=bearer(TOKEN_A))
        ]
        await jobs.CancelBatchJob(j.CancelBatchJobRequest(id=slow), metadata=bearer(TOKEN_A))
        await until(lambda: runner.in_flight == 0, "the slow job's items stopped")
        job_id = await create(jobs, TOKEN_A, *(f"p{n} q" for n in range(5)))
        items = await results(jobs, TOKEN_A, job_id)
        assert len(items) == 5 and all(item.HasField("response") for item in items)
        replies.append(
            await calls.Generate(g.GenerateRequest(model="echo", prompt="again"), metadata=bearer(TOKEN_A))
        )
        with pytest.raises(grpc.aio.AioRpcError) as over:  # the quota is real: 2 calls a minute
            await calls.Generate(g.GenerateRequest(model="echo", prompt="more"), metadata=bearer(TOKEN_A))
        assert reason(over.value) == "REQUEST_RATE_EXCEEDED"
    m = await scrape(server)
    genai = {"gen_ai_request_model": "echo", "caller": "team-a"}
    assert (
        m.value("gen_ai_server_request_duration_seconds_count", gen_ai_operation_name="batch_job", **genai)
        == 5
    )
    assert (  # two served, one refused
        m.value("gen_ai_server_request_duration_seconds_count", gen_ai_operation_name="generate", **genai)
        == 3
    )
    assert m.value("gengate_requests_total", model="echo", caller="team-a", code="OK") == 7
    assert m.value("gengate_requests_total", model="echo", caller="team-a", code="RESOURCE_EXHAUSTED") == 1
    assert m.value("gengate_requests_total", model="echo", caller="anonymous") == 0
    assert m.value("gengate_requests_total", model="echo", caller="team-b") == 0
    usages = [item.response.usage for item in items] + [
        reply.usage for reply in replies
    ]  # the job's and the calls'
    input_tokens = sum(u.input_tokens for u in usages)
    output_tokens = sum(u.output_tokens for u in usages)
    assert m.value("gengate_tokens_total", model="echo", caller="team-a", type="input") == input_tokens
    assert m.value("gengate_tokens_total", model="echo", caller="team-a", type="output") == output_tokens > 0
    cost = m.value("gengate_cost_total", model="echo", caller="team-a")
    assert cost == pytest.approx((input_tokens * 2.0 + output_tokens * 10.0) / 1_000_000)
    assert m.value("gengate_cost_total", model="echo", caller="anonymous") == 0


def _request(model: str, prompt: str) -> bytes:
    return bytes(g.GenerateRequest(model=model, prompt=prompt).SerializeToString())


async def _stored_job(url: str, owner: str, *models: str) -> str:
    """A job put straight into the store, as an earlier server (or configuration) left it."""
    store = open_store(url)
    await store.open()
    try:
        job, _ = await store.create_job(
            display_name=owner,
            idempotency_key="",
            options=JobOptions(),
            items=[(_request(model, f"{owner} {i}"), None) for i, model in enumerate(models)],
            owner=owner,
        )
        return job.id
    finally:
        await store.close()


def _code(result: ItemResult) -> int:
    """The gRPC code of a stored result (0 for a response)."""
    return int(status_pb2.Status.FromString(result.payload).code) if result.failed else 0


def _why(result: ItemResult) -> str:
    return reason(status_pb2.Status.FromString(result.payload)) if result.failed else ""


async def test_items_are_checked_for_their_owner_as_they_run(
    make_server: ServerFactory, store_url: str
) -> None:
    """Jobs left in the store by an earlier configuration: team-a's, made when it could use gpt;
    one of a caller since removed; one from before jobs had owners."""
    of_a = await _stored_job(store_url, "team-a", "gpt", "echo")
    of_gone = await _stored_job(store_url, "team-gone", "echo")
    of_nobody = await _stored_job(store_url, "", "echo")
    callers = [{**CALLERS[0], "models": ["echo"]}, CALLERS[1]]
    server = await make_server(config(store_url, callers))
    runner, store = server.jobs, server.job_store
    assert runner is not None and store is not None
    await until(lambda: runner.finished_items == 4, "every item ran")
    denied = grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert [(_code(r), _why(r)) for _, r in await store.results(of_a, -1, 9) if r] == [
        (denied, "MODEL_NOT_ALLOWED"),
        (0, ""),
    ]
    assert [(_code(r), _why(r)) for _, r in await store.results(of_gone, -1, 9) if r] == [
        (denied, "JOB_OWNER_UNKNOWN")
    ]
    assert [_code(r) for _, r in await store.results(of_nobody, -1, 9) if r] == [0]
    async with grpc.aio.insecure_channel(server.address) as channel:
        jobs = Stub(channel)
        assert await listed(jobs, TOKEN_A, page_size=10) == [of_a]
        assert await listed(jobs, TOKEN_B, page_size=10) == []
        assert [i.error.code for i in await results(jobs, TOKEN_A, of_a)] == [denied, 0]
        for job_id in (of_gone, of_nobody):
            assert (await refusal(jobs, TOKEN_A, job_id, "get")).code() == grpc.StatusCode.NOT_FOUND
    m = await scrape(server)
    assert m.value("gengate_requests_total", model="gpt", caller="team-a", code="PERMISSION_DENIED") == 1
    assert m.value("gengate_requests_total", model="echo", caller="team-a", code="OK") == 1
    assert (
        m.value("gengate_requests_total", model="echo", caller="anonymous", code="OK") == 1
    )  # the ownerless job


async def test_without_callers_every_job_is_everyones(make_server: ServerFactory, store_url: str) -> None:
    """A store holding team-a's job, served without callers: everything as before owners."""
    owned = await _stored_job(store_url, "team-a", "echo", "echo")
    server = await make_server(config(store_url, callers=None))
    async with grpc.aio.insecure_channel(server.address) as channel:
        jobs = Stub(channel)
        new = (
            await jobs.CreateBatchJob(
                j.CreateBatchJobRequest(
                    requests=[g.GenerateRequest(model="echo", prompt="n")], idempotency_key="k"
                )
            )
        ).job.id
        again = await jobs.CreateBatchJob(
            j.CreateBatchJobRequest(
                requests=[g.GenerateRequest(model="echo", prompt="m")], idempotency_key="k"
            )
        )
        assert again.job.id == new
        assert set(await listed(jobs, None, page_size=1)) == {owned, new}
        assert len(await results(jobs, None, owned)) == 2
        assert (
            await jobs.GetBatchJob(j.GetBatchJobRequest(id=owned))
        ).job.state == j.BATCH_JOB_STATE_SUCCEEDED
    m = await scrape(server)
    assert m.value("gengate_requests_total", model="echo", caller="anonymous", code="OK") >= 2
    assert m.value("gengate_requests_total", model="echo", caller="team-a") == 0
