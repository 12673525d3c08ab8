"""Callers over gRPC: tokens (by variable or by digest) name callers, a caller uses only its
models (everywhere models are named: calls, streams, batch items, batch jobs, ListModels,
health), and its quotas answer RESOURCE_EXHAUSTED with RetryInfo and `retry-after`."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from gengate_client import AsyncClient
from gengate_client.errors import (
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from observe import ServerFactory, reason, status_of, until
from teams import SHA_C, TOKEN_A, TOKEN_B, TOKEN_C, bearer, record_calls, with_callers

MODELS = [
    {"name": "tiny", "backend": "scripted", "text": "one two three four"},
    {"name": "gpt", "backend": "scripted", "text": "five six"},
    {"name": "slow", "backend": "scripted", "text": "a b c d e f g h i j k l", "tokens_per_s": 20},
]


def retry_delay_s(error: grpc.aio.AioRpcError) -> float:
    for detail in status_of(error).details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return float(info.retry_delay.ToTimedelta().total_seconds())
    raise AssertionError("no RetryInfo")


def trailing(error: grpc.aio.AioRpcError, key: str) -> str | None:
    for k, v in error.trailing_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


async def test_each_token_names_its_caller_and_others_are_refused(make_server: ServerFactory) -> None:
    server = await make_server(
        with_callers(
            MODELS,
            [
                {"name": "team-a", "token_env": "TEAM_A_TOKEN", "models": ["tiny"]},
                {"name": "team-c", "token_sha256": SHA_C, "models": ["gpt"]},
            ],
        )
    )
    async with AsyncClient(server.address) as client:
        for token, model in ((TOKEN_A, "tiny"), (TOKEN_C, "gpt")):
            models = await client.list_models(metadata=bearer(token))
            assert [m.name for m in models] == [model]  # ListModels shows the caller's models only
            reply = await client.generate(model, "hi", metadata=bearer(token))
            assert reply.generations[0].text
        with pytest.raises(UnauthenticatedError) as caught:
            await client.generate("tiny", "hi", metadata=bearer(TOKEN_B))  # not configured here
        assert caught.value.reason == "INVALID_CREDENTIALS"
        with pytest.raises(UnauthenticatedError) as caught:
            await client.generate("tiny", "hi")
        assert caught.value.reason == "MISSING_CREDENTIALS"
        assert TOKEN_B not in caught.value.message


async def test_a_model_the_caller_may_not_use_is_refused_wherever_it_is_named(
    make_server: ServerFactory,
) -> None:
    server = await make_server(
        with_callers(MODELS, [{"name": "team-a", "token_env": "TEAM_A_TOKEN", "models": ["tiny", "slow"]}])
    )
    async with AsyncClient(server.address, metadata=bearer(TOKEN_A)) as client:
        for model in ("gpt", "ghost"):  # served or not: the caller learns nothing of other models
            with pytest.raises(PermissionDeniedError) as caught:
                await client.generate(model, "hi")
            assert caught.value.reason == "MODEL_NOT_ALLOWED"
            assert caught.value.metadata["model"] == model and caught.value.metadata["caller"] == "team-a"
            assert "gpt" not in caught.value.message.replace(f"'{model}'", "")  # allowed ones only
        with pytest.raises(PermissionDeniedError):
            async for _ in client.generate_stream("gpt", "hi"):
                pass
        items = await client.batch_generate(
            [{"model": "tiny", "prompt": "a"}, {"model": "gpt", "prompt": "b"}]
        )
        assert items[0].ok
        assert (
            isinstance(items[1].error, PermissionDeniedError) and items[1].error.reason == "MODEL_NOT_ALLOWED"
        )
        assert [m.name for m in await client.list_models()] == ["tiny", "slow"]

        job = await client.batch_jobs.create(
            [{"model": "gpt", "prompt": "b"}, {"model": "tiny", "prompt": "a"}]
        )
        results = [r async for r in client.batch_jobs.results(job.id)]
        assert isinstance(results[0].error, PermissionDeniedError)
        assert results[0].error.reason == "MODEL_NOT_ALLOWED"
        assert results[1].ok

    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        tiny = health_pb2.HealthCheckRequest(service="gengate.v1.GenerationService/tiny")
        assert (
            await health.Check(tiny, metadata=bearer(TOKEN_A))
        ).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health.Check(
                health_pb2.HealthCheckRequest(service="gengate.v1.GenerationService/gpt"),
                metadata=bearer(TOKEN_A),
            )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_requests_per_minute_refuses_with_retry_info_and_retry_after(
    make_server: ServerFactory,
) -> None:
    server = await make_server(
        with_callers(
            MODELS,
            [
                {"name": "team-a", "token_env": "TEAM_A_TOKEN", "requests_per_minute": 3},
                {"name": "team-b", "token_env": "TEAM_B_TOKEN"},
            ],
        )
    )
    request = g.GenerateRequest(model="tiny", prompt="hi")
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        await stub.Generate(request, metadata=bearer(TOKEN_A))
        await stub.Generate(request, metadata=bearer(TOKEN_A))
        async for _ in stub.GenerateStream(
            g.GenerateStreamRequest(request=request), metadata=bearer(TOKEN_A)
        ):
            pass
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(request, metadata=bearer(TOKEN_A))
        error = caught.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason(error) == "REQUEST_RATE_EXCEEDED"
        delay = retry_delay_s(error)
        assert 0 < delay <= 60
        after = trailing(error, "retry-after")
        assert after is not None and 1 <= int(after) <= 60
        assert "team-a" in (error.details() or "") and TOKEN_A not in (error.details() or "")
        # ListModels is no generation: not counted; another caller has its own quota.
        await stub.ListModels(g.ListModelsRequest(), metadata=bearer(TOKEN_A))
        await stub.Generate(request, metadata=bearer(TOKEN_B))

    async with AsyncClient(server.address, metadata=bearer(TOKEN_A)) as client:
        items = await client.batch_generate([{"model": "tiny", "prompt": "x"}] * 2)
        for item in items:  # each batch item is a request: over the quota, each fails on its own
            assert isinstance(item.error, ResourceExhaustedError)
            assert item.error.reason == "REQUEST_RATE_EXCEEDED" and item.error.retry_after


async def test_tokens_per_minute_are_charged_as_usage_is_known(make_server: ServerFactory) -> None:
    # "hi" is 1 input token, tiny answers 4: each call costs 5 tokens.
    callers = [{"name": "team-a", "token_env": "TEAM_A_TOKEN", "tokens_per_minute": 9}]
    server = await make_server(with_callers(MODELS, callers))
    async with AsyncClient(server.address, metadata=bearer(TOKEN_A)) as client:
        first = await client.generate("tiny", "hi")
        assert first.usage.input_tokens + first.usage.output_tokens == 5
        frames = [f async for f in client.generate_stream("tiny", "hi")]  # 4 left: admitted, goes to 10
        assert frames
        with pytest.raises(ResourceExhaustedError) as caught:
            await client.generate("tiny", "hi")
        assert caught.value.reason == "TOKEN_RATE_EXCEEDED"
        assert caught.value.metadata == {"caller": "team-a", "limit": "tokens_per_minute", "quota": "9"}
        assert caught.value.retry_after is not None and 0 < caught.value.retry_after <= 60


async def test_max_concurrency_counts_a_callers_calls_across_models(make_server: ServerFactory) -> None:
    models = [
        *MODELS,
        {"name": "slow2", "backend": "scripted", "text": "a b c d e f g h i j k l", "tokens_per_s": 20},
    ]
    callers = [
        {"name": "team-a", "token_env": "TEAM_A_TOKEN", "max_concurrency": 2},
        {"name": "team-b", "token_env": "TEAM_B_TOKEN", "max_concurrency": 1},
    ]
    server = await make_server(with_callers(models, callers))
    # No client retries: the refusal itself is under test (a retry would wait out the streams).
    async with AsyncClient(server.address, metadata=bearer(TOKEN_A), max_retries=0) as client:
        streams = [client.generate_stream(model, "x") for model in ("slow", "slow2")]
        for stream in streams:
            await anext(stream)  # both in flight, on two models
        with pytest.raises(ResourceExhaustedError) as caught:
            await client.generate("tiny", "hi")
        assert caught.value.reason == "CALLER_CONCURRENCY_EXCEEDED" and caught.value.retry_after
        assert (await client.generate("tiny", "hi", metadata=bearer(TOKEN_B))).generations  # its own count
        for stream in streams:
            async for _ in stream:
                pass
        assert (await client.generate("tiny", "hi")).generations
    async with AsyncClient(server.address, metadata=bearer(TOKEN_B)) as client:
        # A batch's items wait for room under max_concurrency instead of failing.
        items = await client.batch_generate([{"model": "tiny", "prompt": f"p{i}"} for i in range(4)])
        assert all(item.ok for item in items)


async def test_the_old_token_variable_is_one_caller_without_limits(
    make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GG_TOKENS", "legacy-token-12345678")
    server = await make_server({"models": MODELS, "server": {"auth_tokens_env": "GG_TOKENS"}})
    async with AsyncClient(server.address, metadata=bearer("legacy-token-12345678")) as client:
        replies = await asyncio.gather(*(client.generate("tiny", "hi") for _ in range(20)))
        assert len(replies) == 20
        assert {m.name for m in await client.list_models()} == {"tiny", "gpt", "slow"}


async def test_stream_releases_its_concurrency_when_the_caller_cancels(make_server: ServerFactory) -> None:
    callers = [{"name": "team-a", "token_env": "TEAM_A_TOKEN", "max_concurrency": 1}]
    server = await make_server(with_callers(MODELS, callers))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        call = stub.GenerateStream(
            g.GenerateStreamRequest(request=g.GenerateRequest(model="slow", prompt="x")),
            metadata=bearer(TOKEN_A),
        )
        await call.read()
        call.cancel()
        route = server.router.route("slow")
        await until(lambda: route.in_flight == 0, "the cancelled stream left its slot")
        reply = await stub.Generate(g.GenerateRequest(model="tiny", prompt="hi"), metadata=bearer(TOKEN_A))
        assert reply.generations


def _unused(*_: Any) -> None:  # keeps imports used by helpers above honest for linters
    return None


@pytest.mark.parametrize("metrics", [False, True], ids=["plain", "with-metrics"])
async def test_a_caller_with_quotas_finds_a_full_queue_full(
    make_server: ServerFactory, metrics: bool
) -> None:
    # Quotas (and metrics) wrap the call: the model's queue bound must still hold for it.
    narrow = [{"name": "narrow", "backend": "scripted", "max_concurrency": 1, "max_queue": 1}]
    callers = [{"name": "team-a", "token_env": "TEAM_A_TOKEN", "requests_per_minute": 1000}]
    server_settings: dict[str, Any] = {"metrics": {"port": 0}} if metrics else {}
    server = await make_server(with_callers(narrow, callers, **server_settings))
    release = asyncio.Event()
    seen = record_calls(server, "narrow", release)
    route = server.router.route("narrow")
    async with AsyncClient(server.address, metadata=bearer(TOKEN_A), max_retries=0) as client:
        holder = asyncio.create_task(client.generate("narrow", "holder"))
        await until(lambda: seen == ["holder"], "the holder has the slot")
        queued = asyncio.create_task(client.generate("narrow", "queued"))
        await until(lambda: route.waiting == 1, "one call queued")
        with pytest.raises(ResourceExhaustedError) as full:
            await client.generate("narrow", "one too many", timeout=30)  # unbounded: it would wait
        assert full.value.reason == "QUEUE_FULL"
        release.set()
        await asyncio.gather(holder, queued)


async def test_batch_items_wait_for_room_under_their_callers_max_concurrency(
    make_server: ServerFactory,
) -> None:
    # A batch bounds itself: its items over the caller's max_concurrency wait instead of failing.
    callers = [
        {"name": "team-a", "token_env": "TEAM_A_TOKEN", "max_concurrency": 1, "requests_per_minute": 1000}
    ]
    server = await make_server(with_callers(MODELS, callers))
    async with AsyncClient(server.address, metadata=bearer(TOKEN_A), max_retries=0) as client:
        items = await client.batch_generate([{"model": "slow", "prompt": f"p{i}"} for i in range(3)])
    assert [item.error for item in items] == [None, None, None]
    assert all(item.response is not None and item.response.text for item in items)
