"""Offline batch jobs end to end: CreateBatchJob with `options.offline` on a real server whose
`openai` and `anthropic` models point at loopback Batch / Message Batches APIs (driven through
the real SDKs). Items go up as one provider batch per model, results stream back in index
order with the online validation, usage is counted, a restarted server resumes polling the
same batches, a cancel reaches the upstream, and a model without a batch API says so per item."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[openai])")
pytest.importorskip("anthropic", reason="the anthropic SDK is not installed (extra: gengate[anthropic])")

sys.path.insert(0, str(Path(__file__).parent.parent / "providers"))

import fake_anthropic
import fake_openai
from fake_anthropic_batch import FakeAnthropicBatches
from fake_openai_batch import FakeOpenAIBatches
from gengate.api.server import RunningServer, start_server
from gengate.config import parse_config
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import jobs_pb2 as j
from gengate_proto.v1 import jobs_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from observe import ServerFactory, reason, until

PERSON = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
)
SCHEMA = t.StructuredOutput(json_schema=t.JsonSchema(schema_json=PERSON, name="person"))


@pytest.fixture(scope="module")
def gpt() -> Iterator[FakeOpenAIBatches]:
    fake = FakeOpenAIBatches()
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def claude() -> Iterator[FakeAnthropicBatches]:
    fake = FakeAnthropicBatches()
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def config(gpt: FakeOpenAIBatches, claude: FakeAnthropicBatches) -> dict[str, Any]:
    gpt.reset()
    claude.reset()
    return {
        "models": [
            {
                "name": "gpt",
                "backend": "openai",
                "model": "gpt-fake",
                "base_url": gpt.server.base_url + "/v1",
                "api_key": fake_openai.API_KEY,
            },
            {
                "name": "claude",
                "backend": "anthropic",
                "model": "claude-test",
                "base_url": claude.server.base_url,
                "api_key": fake_anthropic.API_KEY,
            },
            {"name": "echo", "backend": "scripted"},
        ],
        "server": {"jobs": {"poll_s": 0.05, "offline_poll_s": 0.05}},
    }


@pytest.fixture
async def served(make_server: ServerFactory, config: dict[str, Any]) -> RunningServer:
    return await make_server(config)


@pytest.fixture
async def jobs(served: RunningServer) -> AsyncIterator[jobs_pb2_grpc.BatchJobServiceStub]:
    async with grpc.aio.insecure_channel(served.address) as channel:
        yield jobs_pb2_grpc.BatchJobServiceStub(channel)


def ask(prompt: str, model: str = "gpt", **kw: Any) -> g.GenerateRequest:
    return g.GenerateRequest(model=model, prompt=prompt, **kw)


async def create(stub: jobs_pb2_grpc.BatchJobServiceStub, requests: list[g.GenerateRequest]) -> j.BatchJob:
    options = j.BatchJobOptions(offline=True)
    return (await stub.CreateBatchJob(j.CreateBatchJobRequest(requests=requests, options=options))).job


async def results(
    stub: jobs_pb2_grpc.BatchJobServiceStub, job_id: str
) -> list[j.StreamBatchJobResultsResponse]:
    request = j.StreamBatchJobResultsRequest(id=job_id, follow=True)
    return [item async for item in stub.StreamBatchJobResults(request)]


async def get(stub: jobs_pb2_grpc.BatchJobServiceStub, job_id: str) -> j.BatchJob:
    return (await stub.GetBatchJob(j.GetBatchJobRequest(id=job_id))).job


def code(name: str) -> int:
    return int(getattr(grpc.StatusCode, name).value[0])


async def until_stored(server: RunningServer, job_id: str, batches: int) -> None:
    """Waits until the job's provider state holds `batches` batch ids (stored before polling)."""
    assert server.job_store is not None
    while True:
        state = await server.job_store.provider_state(job_id)
        if state is not None and len(state["batches"]) >= batches:
            return
        await asyncio.sleep(0.02)


def chat_calls(gpt: FakeOpenAIBatches, claude: FakeAnthropicBatches) -> int:
    """Online calls the fakes answered (an offline job makes none)."""
    return sum(r.path.endswith("/chat/completions") for r in gpt.server.requests) + sum(
        r.path == "/v1/messages" for r in claude.server.requests
    )


async def test_an_offline_job_runs_through_one_provider_batch_per_model(
    jobs: jobs_pb2_grpc.BatchJobServiceStub,
    served: RunningServer,
    gpt: FakeOpenAIBatches,
    claude: FakeAnthropicBatches,
) -> None:
    # gpt's lines are answered in index order, then claude's requests in index order.
    gpt.answers.extend(["g0", "g2 first", "g2 second", json.dumps({"name": "Ada", "age": 36}), '{"name": 1}'])
    claude.answers.extend(["c1", json.dumps({"name": "Bo", "age": 7})])
    requests = [
        ask("zero"),
        ask("one", model="claude"),
        ask("two", n=2),
        ask("three", structured_output=SCHEMA),
        ask("four", structured_output=SCHEMA),  # its answer does not validate
        ask("five", model="claude", structured_output=SCHEMA),
        ask("six", model="no-such-model"),  # refused by the core: its own error
    ]
    job = await create(jobs, requests)
    assert job.options.offline
    items = await results(jobs, job.id)
    assert [i.index for i in items] == list(range(7))
    assert [gen.text for gen in items[0].response.generations] == ["g0"]
    assert items[0].response.model == "gpt"
    assert [gen.text for gen in items[1].response.generations] == ["c1"]
    assert [gen.text for gen in items[2].response.generations] == ["g2 first", "g2 second"]
    assert json.loads(items[3].response.generations[0].text) == {"name": "Ada", "age": 36}
    assert items[4].error.code == code("ABORTED") and reason(items[4].error) == "VALIDATION_FAILED"
    assert json.loads(items[5].response.generations[0].text) == {"name": "Bo", "age": 7}
    assert items[6].error.code == code("NOT_FOUND")
    assert reason(items[6].error) == "MODEL_NOT_FOUND"  # as the online runner answers it
    done = await get(jobs, job.id)
    assert (done.state, done.total, done.done, done.failed) == (j.BATCH_JOB_STATE_SUCCEEDED, 7, 7, 2)
    answered = [i.response for i in items if i.HasField("response")]
    assert done.usage.output_tokens == sum(r.usage.output_tokens for r in answered) > 0
    assert done.usage.input_tokens == sum(r.usage.input_tokens for r in answered) > 0
    assert (gpt.creates, claude.creates) == (1, 1)
    assert [line["custom_id"] for line in next(iter(gpt.inputs.values()))] == ["0", "2", "3", "4"]
    assert [r["custom_id"] for r in next(iter(claude.inputs.values()))] == ["1", "5"]
    assert chat_calls(gpt, claude) == 0
    assert served.job_store is not None
    state = await served.job_store.provider_state(job.id)
    assert state is not None
    assert sorted((b["model"], b["id"]) for b in state["batches"]) == sorted(
        [("gpt", next(iter(gpt.batches))), ("claude", next(iter(claude.batches)))]
    )


async def test_a_restarted_server_resumes_polling_the_same_batches(
    config: dict[str, Any], gpt: FakeOpenAIBatches, claude: FakeAnthropicBatches
) -> None:
    gpt.hold = claude.hold = True
    first = await start_server(parse_config(config), host="127.0.0.1", port=0)
    try:
        async with grpc.aio.insecure_channel(first.address) as channel:
            job = await create(
                jobs_pb2_grpc.BatchJobServiceStub(channel),
                [ask(f"p{i}", model="gpt" if i % 2 else "claude") for i in range(6)],
            )
        await until_stored(first, job.id, 2)
        assert (gpt.creates, claude.creates) == (1, 1)
    finally:
        await first.stop(grace=0.5)
    assert gpt.cancels == claude.cancels == []  # a stop leaves the provider batches running
    polled = gpt.retrieves
    second = await start_server(parse_config(config), host="127.0.0.1", port=0)
    try:
        await until(lambda: gpt.retrieves > polled, "the new server polls the stored batch")
        gpt.hold = claude.hold = False
        async with grpc.aio.insecure_channel(second.address) as channel:
            stub = jobs_pb2_grpc.BatchJobServiceStub(channel)
            items = await results(stub, job.id)
            done = await get(stub, job.id)
    finally:
        await second.stop(grace=0.5)
    assert [i.index for i in items] == list(range(6))
    assert all(i.HasField("response") for i in items)
    assert (done.state, done.done, done.failed) == (j.BATCH_JOB_STATE_SUCCEEDED, 6, 0)
    assert (gpt.creates, claude.creates) == (1, 1)  # resumed, never submitted again


async def test_cancelling_an_offline_job_cancels_its_provider_batches(
    jobs: jobs_pb2_grpc.BatchJobServiceStub,
    served: RunningServer,
    gpt: FakeOpenAIBatches,
    claude: FakeAnthropicBatches,
) -> None:
    gpt.hold = claude.hold = True
    job = await create(jobs, [ask("a"), ask("b", model="claude"), ask("c")])
    await until_stored(served, job.id, 2)
    cancelled = (await jobs.CancelBatchJob(j.CancelBatchJobRequest(id=job.id))).job
    assert cancelled.state == j.BATCH_JOB_STATE_CANCELLED and cancelled.done == 3
    assert gpt.cancels == list(gpt.batches) and claude.cancels == list(claude.batches)
    items = await results(jobs, job.id)
    assert [i.error.code for i in items] == [code("CANCELLED")] * 3


async def test_a_model_without_a_batch_api_ends_its_items_unimplemented(
    jobs: jobs_pb2_grpc.BatchJobServiceStub, gpt: FakeOpenAIBatches
) -> None:
    gpt.answers.append("from the batch")
    job = await create(jobs, [ask("x", model="echo"), ask("y"), ask("z", model="echo")])
    items = await results(jobs, job.id)
    assert [i.index for i in items] == [0, 1, 2]
    for item in (items[0], items[2]):
        assert item.error.code == code("UNIMPLEMENTED") and reason(item.error) == "OFFLINE_UNSUPPORTED"
        assert "'echo'" in item.error.message
    assert items[1].response.generations[0].text == "from the batch"
    done = await get(jobs, job.id)
    assert (done.state, done.done, done.failed) == (j.BATCH_JOB_STATE_SUCCEEDED, 3, 2)


async def test_a_batch_the_provider_refuses_ends_its_items_with_that_error(
    jobs: jobs_pb2_grpc.BatchJobServiceStub, gpt: FakeOpenAIBatches, claude: FakeAnthropicBatches
) -> None:
    gpt.next_outcome = "failed"
    claude.next_outcome = "expired"
    job = await create(jobs, [ask("a"), ask("b", model="claude"), ask("c")])
    items = await results(jobs, job.id)
    assert [reason(i.error) for i in items] == [
        "OFFLINE_BATCH_FAILED",
        "OFFLINE_BATCH_EXPIRED",
        "OFFLINE_BATCH_FAILED",
    ]
    assert "Enqueued token limit" in items[0].error.message
    assert items[1].error.code == code("DEADLINE_EXCEEDED")
    done = await get(jobs, job.id)
    assert (done.state, done.done, done.failed) == (j.BATCH_JOB_STATE_SUCCEEDED, 3, 3)
