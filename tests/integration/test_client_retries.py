"""Client retries over gRPC against a real server: scripted models refuse calls with
RESOURCE_EXHAUSTED (or fail mid-stream) and a probe model counts the calls the server received,
so each test asserts how many attempts the client made."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from gengate.api.server import RunningServer
from gengate_client import DEFAULT_RETRY, AsyncClient, Client, RetryPolicy
from gengate_client.errors import ResourceExhaustedError, UnavailableError

MakeServer = Callable[[dict[str, Any]], Awaitable[RunningServer]]


def _models(**limited: dict[str, Any]) -> dict[str, Any]:
    """A config with each named scripted model plus `<name>-probe` answering its call count."""
    models: list[dict[str, Any]] = []
    for name, options in limited.items():
        models.append({"name": name, "backend": "scripted", "text": "served", **options})
        models.append({"name": f"{name}-probe", "backend": "scripted", "answer_calls_of": name})
    return {"models": models}


async def _calls(client: AsyncClient, model: str) -> int:
    reply = await client.generate(f"{model}-probe", "count")
    return int(reply.generations[0].text)


@pytest.fixture
async def server(make_server: MakeServer) -> RunningServer:
    return await make_server(
        _models(
            flaky={"rate_limit_every": 2, "rate_limit_retry_after_s": 0.05},
            limited={"rate_limit_every": 1, "rate_limit_retry_after_s": 0.05},
            slow_limit={"rate_limit_every": 1, "rate_limit_retry_after_s": 2.0},
            long_limit={"rate_limit_every": 1, "rate_limit_retry_after_s": 30.0},
            breaks={"fail_after_tokens": 1, "text": "one two three"},
        )
    )


async def test_a_refused_call_is_retried_after_the_servers_delay_and_succeeds(server: RunningServer) -> None:
    async with AsyncClient(server.address) as client:
        before = await _calls(client, "flaky")
        reply = await client.generate("flaky", "Hi")
        assert reply.generations[0].text == "served"
        assert await _calls(client, "flaky") - before == 2


async def test_the_sync_client_retries_too(server: RunningServer) -> None:
    def call() -> str:
        with Client(server.address) as client:
            return client.generate("flaky", "Hi").generations[0].text

    async with AsyncClient(server.address) as probe:
        before = await _calls(probe, "flaky")
        assert await asyncio.to_thread(call) == "served"
        assert await _calls(probe, "flaky") - before == 2


async def test_retries_stop_after_max_retries_with_the_servers_error(server: RunningServer) -> None:
    for max_retries, attempts in ((None, DEFAULT_RETRY.max_retries + 1), (0, 1), (4, 5)):
        async with AsyncClient(server.address, max_retries=max_retries) as client:
            before = await _calls(client, "limited")
            with pytest.raises(ResourceExhaustedError) as caught:
                await client.generate("limited", "Hi")
            assert caught.value.reason == "SCRIPTED_RATE_LIMIT"
            assert caught.value.retry_after == pytest.approx(0.05)
            assert await _calls(client, "limited") - before == attempts, max_retries


async def test_a_delay_past_the_callers_deadline_is_not_waited_for(server: RunningServer) -> None:
    """The server says "do not retry" (pushback -1) when its delay would outlast the deadline: the
    caller gets RESOURCE_EXHAUSTED and when to come back, not DEADLINE_EXCEEDED after a wait."""
    async with AsyncClient(server.address) as client:
        before = await _calls(client, "slow_limit")
        with pytest.raises(ResourceExhaustedError) as caught:
            await client.generate("slow_limit", "Hi", timeout=1.0)
        assert caught.value.retry_after == pytest.approx(2.0)
        assert await _calls(client, "slow_limit") - before == 1


async def test_a_delay_past_the_pushback_cap_is_left_to_the_caller(server: RunningServer) -> None:
    async with AsyncClient(server.address) as client:
        before = await _calls(client, "long_limit")
        with pytest.raises(ResourceExhaustedError) as caught:
            await client.generate("long_limit", "Hi")
        assert caught.value.retry_after == pytest.approx(30.0)
        assert await _calls(client, "long_limit") - before == 1


async def test_a_stream_is_retried_before_its_first_frame_only(server: RunningServer) -> None:
    async with AsyncClient(server.address) as client:
        before = await _calls(client, "flaky")
        frames = [frame async for frame in client.generate_stream("flaky", "Hi")]
        assert frames and await _calls(client, "flaky") - before == 2

        before = await _calls(client, "breaks")
        received = []
        with pytest.raises(UnavailableError) as caught:
            async for frame in client.generate_stream("breaks", "Hi"):
                received.append(frame)
        assert caught.value.reason == "SCRIPTED_FAULT"
        assert received, "the stream failed after its first frame"
        assert await _calls(client, "breaks") - before == 1, "a stream past its first frame is never retried"


async def test_a_batch_item_refused_is_that_items_error_not_a_retry(server: RunningServer) -> None:
    """BatchGenerate answers each item's error inside the stream: the call itself succeeded, so
    nothing is retried and the other items are untouched."""
    async with AsyncClient(server.address) as client:
        before = await _calls(client, "limited")
        items = await client.batch_generate(
            [{"model": "limited", "prompt": "a"}, {"model": "flaky-probe", "prompt": "b"}]
        )
        assert isinstance(items[0].error, ResourceExhaustedError)
        assert items[1].error is None
        assert await _calls(client, "limited") - before == 1


def test_the_policy_is_grpcs_own_retry_config_and_job_creation_is_never_retried() -> None:
    config = json.loads(RetryPolicy(max_retries=3, initial_backoff_s=0.5).service_config() or "")
    [method] = config["methodConfig"]
    assert method["retryPolicy"] == {
        "maxAttempts": 4,
        "initialBackoff": "0.5s",
        "maxBackoff": "5.0s",
        "backoffMultiplier": 2.0,
        "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
    }
    names = method["name"]
    assert {"service": "gengate.v1.GenerationService"} in names
    job_methods = {n.get("method") for n in names if n["service"] == "gengate.v1.BatchJobService"}
    assert "GetBatchJob" in job_methods and "StreamBatchJobResults" in job_methods
    assert not job_methods & {"CreateBatchJob", "UploadBatchJob", None}
    assert RetryPolicy(max_retries=0).service_config() is None


@pytest.mark.parametrize(
    "kwargs",
    [{"max_retries": 5}, {"max_retries": -1}, {"initial_backoff_s": 0}, {"retryable_codes": ()}],
)
def test_an_impossible_policy_is_refused_when_made(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


async def test_a_service_config_of_the_callers_own_wins(server: RunningServer) -> None:
    own = json.dumps({"methodConfig": [{"name": [{"service": "gengate.v1.GenerationService"}]}]})
    async with AsyncClient(server.address, options=[("grpc.service_config", own)]) as client:
        before = await _calls(client, "limited")
        with pytest.raises(ResourceExhaustedError):
            await client.generate("limited", "Hi")
        assert await _calls(client, "limited") - before == 1
