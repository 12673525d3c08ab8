"""`client.batch_jobs` against a real server: create (one message, or streamed in pieces past
UPLOAD_ABOVE items), typed results with `output_type`, resume from an index, wait, list and
cancel, and errors as GengateError subclasses."""

from __future__ import annotations

import asyncio

import pytest
from gengate_client import AsyncClient, BatchJob, Client, FailedPreconditionError, NotFoundError, Request
from gengate_client import jobs as client_jobs
from observe import ServerFactory
from pydantic import BaseModel


class Pet(BaseModel):
    name: str


class GetWeather(BaseModel):
    city: str


MODELS = [
    {"name": "echo", "backend": "scripted"},
    {
        "name": "caller",
        "backend": "scripted",
        "tool_calls": [{"id": "call_1", "name": "GetWeather", "arguments": {"city": "Paris"}}],
    },
    {
        "name": "pets",
        "backend": "scripted",
        "text": '{"name": "Rex"}',
        "constraints": {"json_schema": "validated"},
    },
]


@pytest.fixture
async def address(make_server: ServerFactory) -> str:
    return (await make_server({"models": MODELS})).address


async def test_create_then_typed_results_resumed_from_an_index(address: str) -> None:
    def scenario() -> tuple[BatchJob, list[object], list[int]]:
        with Client(address) as client:
            job = client.batch_jobs.create(
                [Request(model="pets", prompt=f"pet {i}", output_type=Pet) for i in range(5)],
                display_name="pets",
            )
            items = list(client.batch_jobs.results(job.id, output_type=Pet))
            resumed = [item.index for item in client.batch_jobs.results(job.id, after_index=2)]
            return client.batch_jobs.wait(job.id, poll_s=0.05), [i.unwrap().parsed for i in items], resumed

    job, parsed, resumed = await asyncio.to_thread(scenario)
    assert parsed == [Pet(name="Rex")] * 5
    assert resumed == [3, 4]
    assert job.state == "succeeded" and (job.total, job.done, job.failed) == (5, 5, 0) and job.finished
    assert job.display_name == "pets" and job.create_time is not None and job.end_time is not None


async def test_job_results_given_the_tools_parse_calls_into_their_types(address: str) -> None:
    """A job's stored calls come back linked to the tools passed to `results`, sync and async, so
    `arguments()` gives the tool's model; without `tools` they stay plain dicts."""
    with Client(address) as client:
        job = await asyncio.to_thread(
            client.batch_jobs.create, [Request(model="caller", prompt="weather?", tools=[GetWeather])] * 2
        )
        typed = await asyncio.to_thread(lambda: list(client.batch_jobs.results(job.id, tools=[GetWeather])))
        plain = await asyncio.to_thread(lambda: list(client.batch_jobs.results(job.id)))
    async with AsyncClient(address) as aclient:
        atyped = [item async for item in aclient.batch_jobs.results(job.id, tools=[GetWeather])]
    for item in typed + atyped:
        (call,) = item.unwrap().tool_calls
        assert call.name == "GetWeather" and call.arguments() == GetWeather(city="Paris")
    assert [item.unwrap().tool_calls[0].arguments() for item in plain] == [{"city": "Paris"}] * 2


async def test_a_large_job_is_uploaded_in_pieces(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_jobs, "UPLOAD_ABOVE", 10)

    def scenario() -> tuple[BatchJob, list[str]]:
        with Client(address) as client:
            job = client.batch_jobs.create([{"model": "echo", "prompt": f"u{i}"} for i in range(25)])
            texts = [item.unwrap().text for item in client.batch_jobs.results(job.id)]
            return job, texts

    job, texts = await asyncio.to_thread(scenario)
    assert job.total == 25 and texts == [f"u{i}" for i in range(25)]


async def test_jsonl_with_defaults_list_and_errors(address: str) -> None:
    def scenario() -> None:
        with Client(address) as client:
            job = client.batch_jobs.create(
                jsonl=['{"prompt": "a"}', "not json", '{"messages": [{"role": "user", "content": "b"}]}'],
                defaults={"model": "echo", "max_tokens": 4},
                idempotency_key="same",
            )
            items = list(client.batch_jobs.results(job.id))
            assert [i.ok for i in items] == [True, False, True]
            assert items[0].unwrap().text == "a" and items[2].unwrap().text == "b"
            assert client.batch_jobs.create(jsonl=["{}"], idempotency_key="same").id == job.id
            assert job.id in [j.id for j in client.batch_jobs.list(page_size=1)]
            with pytest.raises(NotFoundError):
                client.batch_jobs.get("job-missing")
            with pytest.raises(FailedPreconditionError):
                client.batch_jobs.cancel(job.id)
            with pytest.raises(ValueError):
                client.batch_jobs.create()

    await asyncio.to_thread(scenario)


async def test_the_async_client_has_the_same_jobs(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_jobs, "UPLOAD_ABOVE", 3)
    async with AsyncClient(address) as client:
        small = await client.batch_jobs.create([Request(model="pets", prompt="p", output_type=Pet)])
        large = await client.batch_jobs.create([{"model": "echo", "prompt": f"a{i}"} for i in range(5)])
        parsed = [item.unwrap().parsed async for item in client.batch_jobs.results(small.id, output_type=Pet)]
        texts = [item.unwrap().text async for item in client.batch_jobs.results(large.id, after_index=1)]
        assert parsed == [Pet(name="Rex")] and texts == ["a2", "a3", "a4"]
        assert (await client.batch_jobs.wait(large.id, poll_s=0.05)).state == "succeeded"
        listed = [job.id async for job in client.batch_jobs.list(page_size=1)]
        assert listed[:2] == [large.id, small.id]
        with pytest.raises(FailedPreconditionError):
            await client.batch_jobs.cancel(large.id)
        with pytest.raises(NotFoundError):
            await client.batch_jobs.get("job-missing")
