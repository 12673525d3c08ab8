"""BatchJobService over a real server on port 0, with scripted models and the default SQLite
store: create, upload, get, list, cancel and resumable results, per-item errors as BatchGenerate
answers them, idempotent creates, and the errors bad calls get."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from gengate.api.server import RunningServer
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc, jobs_pb2_grpc
from gengate_proto.v1 import jobs_pb2 as j
from gengate_proto.v1 import types_pb2 as t
from observe import ServerFactory, reason, until

MODELS: list[dict[str, Any]] = [
    {"name": "echo", "backend": "scripted"},
    {
        "name": "slow",
        "backend": "scripted",
        "text": " ".join(f"w{i}" for i in range(200)),
        "tokens_per_s": 50,
    },
]


def ask(prompt: str, model: str = "echo", **kw: Any) -> g.GenerateRequest:
    return g.GenerateRequest(model=model, prompt=prompt, **kw)


@pytest.fixture
async def served(make_server: ServerFactory) -> RunningServer:
    return await make_server({"models": MODELS, "server": {"jobs": {"concurrency": 4, "max_items": 50}}})


@pytest.fixture
async def jobs(served: RunningServer) -> AsyncIterator[jobs_pb2_grpc.BatchJobServiceStub]:
    async with grpc.aio.insecure_channel(served.address) as channel:
        yield jobs_pb2_grpc.BatchJobServiceStub(channel)


async def results(
    stub: jobs_pb2_grpc.BatchJobServiceStub, job_id: str, after: int | None = None, follow: bool = True
) -> list[j.StreamBatchJobResultsResponse]:
    request = j.StreamBatchJobResultsRequest(id=job_id, follow=follow)
    if after is not None:
        request.after_index = after
    return [item async for item in stub.StreamBatchJobResults(request)]


async def test_a_job_runs_every_item_and_streams_results_in_index_order(
    jobs: jobs_pb2_grpc.BatchJobServiceStub,
) -> None:
    bad_schema = t.StructuredOutput(json_schema=t.JsonSchema(schema_json="{not json"))
    requests = [
        ask("zero"),
        ask("one", structured_output=bad_schema),  # refused at create: its own error
        ask("two", model="no-such-model"),  # refused when it runs: its own error too
        *[ask(f"item {i}") for i in range(3, 12)],
    ]
    created = (await jobs.CreateBatchJob(j.CreateBatchJobRequest(requests=requests, display_name="d"))).job
    assert created.id.startswith("job-") and created.total == 12 and created.display_name == "d"
    assert created.state in (j.BATCH_JOB_STATE_QUEUED, j.BATCH_JOB_STATE_RUNNING)
    items = await results(jobs, created.id)
    assert [item.index for item in items] == list(range(12))
    assert items[0].response.generations[0].text == "zero"
    assert items[11].response.generations[0].text == "item 11"
    assert items[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "requests[1].structured_output.json_schema" in items[1].error.message
    assert items[2].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    done = (await jobs.GetBatchJob(j.GetBatchJobRequest(id=created.id))).job
    assert (done.state, done.total, done.done, done.failed) == (j.BATCH_JOB_STATE_SUCCEEDED, 12, 12, 2)
    assert done.usage.output_tokens == sum(
        i.response.usage.output_tokens for i in items if i.HasField("response")
    )
    assert done.usage.output_tokens > 0
    assert done.end_time.seconds >= done.start_time.seconds >= done.create_time.seconds > 0


async def test_results_resume_after_any_index(jobs: jobs_pb2_grpc.BatchJobServiceStub) -> None:
    job = (await jobs.CreateBatchJob(j.CreateBatchJobRequest(requests=[ask(f"p{i}") for i in range(6)]))).job
    everything = await results(jobs, job.id)
    assert [i.index for i in await results(jobs, job.id, after=3)] == [4, 5]
    assert [i.index for i in await results(jobs, job.id, after=5)] == []
    assert await results(jobs, job.id, after=2**64 - 1) == []  # the largest uint64: nothing, no error
    again = await results(jobs, job.id, after=-1 + 1)  # after index 0
    assert [i.index for i in again] == [1, 2, 3, 4, 5]
    assert [i.SerializeToString() for i in again] == [i.SerializeToString() for i in everything[1:]]


async def test_without_follow_results_stop_at_the_first_unfinished_item(
    jobs: jobs_pb2_grpc.BatchJobServiceStub, served: RunningServer
) -> None:
    job = (await jobs.CreateBatchJob(j.CreateBatchJobRequest(requests=[ask("x", model="slow")] * 3))).job
    assert await results(jobs, job.id, follow=False) == []  # nothing finished yet: no gap is skipped
    assert served.jobs is not None
    await until(lambda: served.jobs is not None and served.jobs.in_flight > 0, "the job is running")
    cancelled = (await jobs.CancelBatchJob(j.CancelBatchJobRequest(id=job.id))).job
    assert cancelled.state == j.BATCH_JOB_STATE_CANCELLED and cancelled.done == cancelled.total == 3
    items = await results(jobs, job.id, follow=False)
    assert [i.index for i in items] == [0, 1, 2]
    assert all(i.error.code == grpc.StatusCode.CANCELLED.value[0] for i in items)
    await until(lambda: served.jobs is not None and served.jobs.in_flight == 0, "the items were stopped")
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await jobs.CancelBatchJob(j.CancelBatchJobRequest(id=job.id))
    assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION and reason(again.value) == "JOB_FINISHED"


async def test_a_retried_create_with_the_same_key_makes_no_second_job(
    jobs: jobs_pb2_grpc.BatchJobServiceStub,
) -> None:
    first = (
        await jobs.CreateBatchJob(j.CreateBatchJobRequest(requests=[ask("a")], idempotency_key="k1"))
    ).job
    second = (
        await jobs.CreateBatchJob(
            j.CreateBatchJobRequest(requests=[ask("a"), ask("b")], idempotency_key="k1")
        )
    ).job
    assert second.id == first.id and second.total == 1
    listed = (await jobs.ListBatchJobs(j.ListBatchJobsRequest())).jobs
    assert [job.id for job in listed].count(first.id) == 1


async def test_upload_streams_a_large_job_in(jobs: jobs_pb2_grpc.BatchJobServiceStub) -> None:
    async def parts() -> AsyncIterator[j.UploadBatchJobRequest]:
        yield j.UploadBatchJobRequest(header=j.BatchJobHeader(display_name="up", idempotency_key="u1"))
        for i in range(30):
            yield j.UploadBatchJobRequest(request=ask(f"u{i}"))

    job = (await jobs.UploadBatchJob(parts())).job
    assert job.total == 30 and job.display_name == "up"
    items = await results(jobs, job.id)
    assert [i.response.generations[0].text for i in items] == [f"u{i}" for i in range(30)]
    retried = (await jobs.UploadBatchJob(parts())).job
    assert retried.id == job.id  # the key makes a retried upload the same job


async def test_list_pages_newest_first(jobs: jobs_pb2_grpc.BatchJobServiceStub) -> None:
    made = [
        (await jobs.CreateBatchJob(j.CreateBatchJobRequest(requests=[ask("x")]))).job.id for _ in range(5)
    ]
    seen: list[str] = []
    token = ""
    while True:
        page = await jobs.ListBatchJobs(j.ListBatchJobsRequest(page_size=2, page_token=token))
        assert len(page.jobs) <= 2
        seen += [job.id for job in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert seen == list(reversed(made))


async def test_bad_calls_get_precise_statuses(jobs: jobs_pb2_grpc.BatchJobServiceStub) -> None:
    cases = [
        (jobs.GetBatchJob(j.GetBatchJobRequest(id="job-nope")), grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND"),
        (jobs.GetBatchJob(j.GetBatchJobRequest()), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD"),
        (jobs.CreateBatchJob(j.CreateBatchJobRequest()), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD"),
        (
            jobs.CreateBatchJob(j.CreateBatchJobRequest(requests=[ask("x")] * 51)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "LIMIT_EXCEEDED",
        ),
        (
            jobs.ListBatchJobs(j.ListBatchJobsRequest(page_token="garbage!")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_FIELD",
        ),
        (
            jobs.CancelBatchJob(j.CancelBatchJobRequest(id="job-nope")),
            grpc.StatusCode.NOT_FOUND,
            "JOB_NOT_FOUND",
        ),
    ]
    for call, code, why in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert (caught.value.code(), reason(caught.value)) == (code, why), caught.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as limit:
        await jobs.CreateBatchJob(j.CreateBatchJobRequest(requests=[ask("x")] * 51))
    assert "server.jobs.max_items" in (limit.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        async for _ in jobs.StreamBatchJobResults(j.StreamBatchJobResultsRequest(id="job-nope")):
            pass
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


async def test_interactive_calls_go_before_the_jobs_items(make_server: ServerFactory) -> None:
    """One slot, a job holding four items waiting for it: a caller is neither refused by the
    queue limit nor made to wait behind them; it runs when the item in progress ends."""
    model = {"name": "one", "backend": "scripted", "text": "a b c d e f", "tokens_per_s": 60,
             "max_concurrency": 1, "max_queue": 1}  # fmt: skip
    server = await make_server({"models": [model], "server": {"jobs": {"concurrency": 5}}})
    route = server.router.route("one")
    async with grpc.aio.insecure_channel(server.address) as channel:
        jobs = jobs_pb2_grpc.BatchJobServiceStub(channel)
        calls = generation_pb2_grpc.GenerationServiceStub(channel)
        job = (await jobs.CreateBatchJob(j.CreateBatchJobRequest(requests=[ask("x", model="one")] * 8))).job
        await until(lambda: route.in_flight == 1 and route.background_waiting == 4, "the job's items wait")
        reply = await calls.Generate(ask("now", model="one"))
        assert reply.generations[0].text == "a b c d e f"
        done = (await jobs.GetBatchJob(j.GetBatchJobRequest(id=job.id))).job.done
        assert done <= 1  # only the item already running finished before the call
        await jobs.CancelBatchJob(j.CancelBatchJobRequest(id=job.id))


async def test_hostile_jsonl_lines_are_their_items_errors(jobs: jobs_pb2_grpc.BatchJobServiceStub) -> None:
    """A line nested past any parser's depth and a large one (parsed off the event loop) end as
    their own items; the job and the server go on."""

    async def parts() -> AsyncIterator[j.UploadBatchJobRequest]:
        yield j.UploadBatchJobRequest(header=j.BatchJobHeader(defaults=ask("")))
        yield j.UploadBatchJobRequest(json_line="[" * 200_000 + "]" * 200_000)
        yield j.UploadBatchJobRequest(json_line='{"prompt": "' + "x" * 300_000 + '"}')
        yield j.UploadBatchJobRequest(json_line='{"prompt": "ok", "unknownField": 1}')
        yield j.UploadBatchJobRequest(json_line='{"prompt": "fine"}')

    job = (await jobs.UploadBatchJob(parts())).job
    items = await results(jobs, job.id)
    assert [reason(i.error) if i.HasField("error") else "" for i in items] == [
        "INVALID_JSON_LINE", "", "INVALID_JSON_LINE", ""
    ]  # fmt: skip
    assert (
        len(items[1].response.generations[0].text) == 300_000
        and items[3].response.generations[0].text == "fine"
    )
