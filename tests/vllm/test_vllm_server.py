"""gengate's gRPC server serving a vLLM model, called through the Python client: the user's view.

Typed structured output, streams, BatchGenerate with per-item results, prefix-cache usage,
ListModels and health, bad input refused with field details while the model keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Literal

import grpc
import pytest
from gengate.api.server import RunningServer, model_health_name, start_server
from gengate.config import parse_config
from gengate_client import Regex, Request
from gengate_client.aio import AsyncClient
from gengate_client.errors import DeadlineExceededError, InvalidArgumentError
from gengate_client.types import ConstraintKind, Enforcement, FinishReason
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    likes: list[Literal["tea", "coffee"]] = Field(max_length=2)


@pytest.fixture(scope="module")
async def server(vllm_entry: dict[str, Any]) -> AsyncIterator[RunningServer]:
    config = parse_config(
        {"models": [vllm_entry, {"name": "echo", "backend": "scripted", "tokens_per_s": 2000}]}
    )
    running = await start_server(config, host="127.0.0.1", port=0)
    yield running
    await running.stop(grace=1.0)


@pytest.fixture(scope="module")
async def client(server: RunningServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(server.address, timeout=120) as c:
        yield c


async def test_list_models_and_health(client: AsyncClient, server: RunningServer) -> None:
    models = {m.name: m for m in await client.list_models()}
    small = models["small"]
    assert small.backend == "vllm"
    assert small.capabilities.context_length == 1024
    for kind in ConstraintKind:
        if kind is not ConstraintKind.UNSPECIFIED:
            assert small.capabilities.enforcement_of(kind) is Enforcement.ENGINE, kind
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=model_health_name("small")))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_typed_object_from_a_pydantic_model(client: AsyncClient) -> None:
    response = await client.generate("small", "Describe a person:", output_type=Person, n=3, seed=5)
    assert response.enforcement is Enforcement.ENGINE
    assert len(response.parsed_all) == 3
    assert all(isinstance(p, Person) for p in response.parsed_all)
    assert response.usage.output_tokens == sum(g.output_tokens for g in response.generations)


async def test_stream_through_grpc(client: AsyncClient) -> None:
    deltas = 0
    text = []
    end = None
    async for event in client.generate_stream("small", "Once upon a time", max_tokens=24, seed=1):
        kind = type(event).__name__
        if kind == "StreamDelta":
            deltas += 1
            text.append(event.text)  # type: ignore[union-attr]
        elif kind == "StreamEnd":
            end = event
    assert deltas > 1 and end is not None
    assert end.usage.output_tokens > 0  # type: ignore[attr-defined]
    whole = await client.generate("small", "Once upon a time", max_tokens=24, seed=1)
    assert "".join(text) == whole.text  # same seed, same text, streamed or not


async def test_batch_generate_gives_each_item_its_own_result(client: AsyncClient) -> None:
    requests: list[Request] = [
        Request(model="small", prompt=f"Colour number {i}:", output_type=Literal["red", "green", "blue"])
        for i in range(20)
    ]
    requests.insert(7, Request(model="small", prompt="too many", n=500))
    requests.insert(12, Request(model="echo", prompt="bystander"))
    items = await client.batch_generate(requests)
    assert [item.index for item in items] == list(range(22))
    bad = items[7]
    assert isinstance(bad.error, InvalidArgumentError)
    assert [v.field for v in bad.error.field_violations] == ["requests[7].n"]
    assert items[12].ok and items[12].unwrap().model == "echo"
    colours = [item.unwrap().parsed for i, item in enumerate(items) if i not in (7, 12)]
    assert len(colours) == 20 and set(colours) <= {"red", "green", "blue"}


async def test_prefix_cache_hits_are_reported(client: AsyncClient) -> None:
    prompt = "Questions and answers: Who wrote the letter? She did. " * 8
    first = await client.generate("small", prompt, max_tokens=2)
    second = await client.generate("small", prompt, max_tokens=2)
    assert second.usage.input_tokens == first.usage.input_tokens > 64
    assert second.usage.cached_input_tokens >= 64


async def test_bad_input_is_refused_with_details_and_the_model_keeps_serving(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        await client.generate("small", "x", output_type=Regex("[0-9"), max_tokens=4)
    assert info.value.field_violations and "regex" in info.value.field_violations[0].field
    with pytest.raises(DeadlineExceededError):
        await client.generate(
            "small", "A long answer:", output_type=Regex("[a-z]{900}"), max_tokens=1000, timeout=0.3
        )
    ok = await client.generate("small", "still there?", max_tokens=3)
    assert ok.usage.output_tokens == 3 and ok.finish_reason is FinishReason.LENGTH


async def test_concurrent_streams_and_unary_calls_all_complete(client: AsyncClient) -> None:
    async def one(i: int) -> int:
        response = await client.generate("small", f"item {i}", max_tokens=16, seed=i)
        return response.usage.output_tokens

    counts = await asyncio.gather(*(one(i) for i in range(48)))
    assert all(count > 0 for count in counts)  # pytest-timeout guards against a hang
