"""Quotas shared by replicas through a real redis-server: one requests_per_minute (and one
tokens_per_minute) holds across two servers; a replica that loses Redis keeps serving with local
limits and says so in health and logs (or refuses, with state_fail_closed), and shares again once
Redis is back. max_concurrency across replicas: tests/callers/test_shared_concurrency.py."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
from gengate.errors import ConfigError
from gengate_client import AsyncClient
from gengate_client.errors import ResourceExhaustedError, UnavailableError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from observe import ServerFactory
from redis_server import RedisServer
from teams import SHA_C, TOKEN_A, TOKEN_B, TOKEN_C, bearer, with_callers

pytest.importorskip("redis")

MODELS = [{"name": "tiny", "backend": "scripted", "text": "one two three four"}]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def config(url: str, callers: list[dict[str, Any]], **server: Any) -> dict[str, Any]:
    return with_callers(MODELS, callers, state=url, **server)


async def _limits_health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="gengate.limits")
        )
        return int(reply.status)


async def test_one_requests_per_minute_holds_across_two_replicas(
    make_server: ServerFactory, redis_url: str
) -> None:
    callers = [
        {"name": "team-a", "token_env": "TEAM_A_TOKEN", "requests_per_minute": 4},
        {"name": "team-b", "token_env": "TEAM_B_TOKEN", "requests_per_minute": 100},
    ]
    first = await make_server(config(redis_url, callers))
    second = await make_server(config(redis_url, callers))
    assert await _limits_health(first.address) == SERVING
    async with AsyncClient(first.address) as one, AsyncClient(second.address) as two:
        for client in (one, two, one, two):  # four requests, two on each replica
            await client.generate("tiny", "hi", metadata=bearer(TOKEN_A))
        for client in (one, two):  # the quota is spent on both
            with pytest.raises(ResourceExhaustedError) as caught:
                await client.generate("tiny", "hi", metadata=bearer(TOKEN_A))
            assert caught.value.reason == "REQUEST_RATE_EXCEEDED"
            assert caught.value.retry_after is not None and 0 < caught.value.retry_after <= 60
        await two.generate("tiny", "hi", metadata=bearer(TOKEN_B))  # another caller, its own window


async def test_tokens_charged_on_one_replica_spend_the_window_on_the_other(
    make_server: ServerFactory, redis_url: str
) -> None:
    callers = [{"name": "team-a", "token_env": "TEAM_A_TOKEN", "tokens_per_minute": 5}]
    first = await make_server(config(redis_url, callers))
    second = await make_server(config(redis_url, callers))
    async with AsyncClient(first.address, metadata=bearer(TOKEN_A)) as one:
        [f async for f in one.generate_stream("tiny", "hi")]  # 1 + 4 tokens, charged as they came
    async with AsyncClient(second.address, metadata=bearer(TOKEN_A)) as two:
        with pytest.raises(ResourceExhaustedError) as caught:
            await two.generate("tiny", "hi")
        assert caught.value.reason == "TOKEN_RATE_EXCEEDED"


async def test_a_replica_that_loses_redis_serves_with_local_limits_and_says_so(
    make_server: ServerFactory, redis_server: RedisServer, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gengate.limits")
    callers = [{"name": "team-a", "token_env": "TEAM_A_TOKEN", "requests_per_minute": 3}]
    server = await make_server(config(redis_url, callers))
    state = server.core.admission.state if server.core is not None else None
    async with AsyncClient(server.address, metadata=bearer(TOKEN_A)) as client:
        await client.generate("tiny", "hi")
        redis_server.stop()
        for _ in range(3):  # served: the local window starts empty, and allows its own 3
            await client.generate("tiny", "hi")
        with pytest.raises(ResourceExhaustedError):
            await client.generate("tiny", "hi")
        assert await _limits_health(server.address) == NOT_SERVING
        assert any("is lost" in r.getMessage() and "local limits" in r.getMessage() for r in caplog.records)
        redis_server.start()
        assert state is not None and hasattr(state, "ping")
        assert await state.ping()  # the next call that tries Redis finds it back
        await client.generate("tiny", "hi")  # the shared window: 1 of 3 used before the outage
        assert await _limits_health(server.address) == SERVING
        assert any("answers again" in r.getMessage() for r in caplog.records)


async def test_with_fail_closed_a_replica_without_redis_refuses_limited_callers(
    make_server: ServerFactory, redis_server: RedisServer, redis_url: str
) -> None:
    callers = [
        {"name": "team-a", "token_env": "TEAM_A_TOKEN", "requests_per_minute": 100},
        {"name": "team-b", "token_env": "TEAM_B_TOKEN", "max_concurrency": 4},  # shared too
        {"name": "team-c", "token_sha256": SHA_C},  # no quota: nothing to share
    ]
    server = await make_server(config(redis_url, callers, state_fail_closed=True))
    redis_server.stop()
    async with AsyncClient(server.address) as client:
        for token in (TOKEN_A, TOKEN_B):
            with pytest.raises(UnavailableError) as caught:
                await client.generate("tiny", "hi", metadata=bearer(token))
            assert caught.value.reason == "LIMITS_UNAVAILABLE" and caught.value.retry_after
        assert (await client.generate("tiny", "hi", metadata=bearer(TOKEN_C))).generations
    assert await _limits_health(server.address) == NOT_SERVING


async def test_a_redis_password_never_shows(
    make_server: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    password = "redis-pass-Zx81QvLm"
    callers = [{"name": "team-a", "token_env": "TEAM_A_TOKEN", "requests_per_minute": 5}]
    server = await make_server(config(f"redis://:{password}@127.0.0.1:1/0", callers))  # nothing listens
    async with AsyncClient(server.address, metadata=bearer(TOKEN_A)) as client:
        await client.generate("tiny", "hi")  # fail-open: served with local limits
    assert password not in caplog.text and "127.0.0.1:1" in caplog.text


def test_a_state_that_is_not_a_redis_url_fails_start_up() -> None:
    from gengate.config import parse_config

    with pytest.raises(ConfigError, match=r"server: state: .*redis://"):
        parse_config({"models": MODELS, "server": {"state": "postgresql://db/limits"}})
