"""A caller's max_concurrency across replicas through a real redis-server: each call in flight
holds a lease in Redis (a sorted set per caller), so two servers together admit no more than the
limit; a lease goes when its call ends (done, failed or cancelled), is extended while its call
runs, and one left by a killed replica stops counting when it expires. Losing Redis: each replica
limits its own calls (fail-open)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from gengate.api.server import RunningServer
from gengate.callers.identity import Caller
from gengate.callers.limits import Admission
from gengate.callers.shared import RedisLimits
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from observe import ServerFactory, reason, status_of, until
from redis_server import RedisServer
from serve_process import ServerProcess
from teams import TOKEN_A, bearer, with_callers

redis = pytest.importorskip("redis")

MODELS = [
    {"name": "tiny", "backend": "scripted", "text": "one two three four"},
    # Streams on it stay in flight until the test ends them (400 tokens at 20 a second).
    {
        "name": "slow",
        "backend": "scripted",
        "text": " ".join(f"w{i}" for i in range(400)),
        "tokens_per_s": 20,
    },
]
KEY = RedisLimits.calls_key("team-a")
Stub = generation_pb2_grpc.GenerationServiceStub


def config(url: str, max_concurrency: int, **server: Any) -> dict[str, Any]:
    caller = {"name": "team-a", "token_env": "TEAM_A_TOKEN", "max_concurrency": max_concurrency}
    return with_callers(MODELS, [caller], state=url, **server)


@asynccontextmanager
async def stub_of(address: str) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(address) as channel:
        yield Stub(channel)


async def hold(stub: Stub) -> Any:
    """A stream of team-a's, in flight once its first message came (admitted: its lease held)."""
    request = g.GenerateStreamRequest(request=g.GenerateRequest(model="slow", prompt="hold"))
    call = stub.GenerateStream(request, metadata=bearer(TOKEN_A))
    await call.read()
    return call


async def generate(stub: Stub, **fields: Any) -> g.GenerateResponse:
    request = g.GenerateRequest(model="tiny", prompt="hi", **fields)
    reply: g.GenerateResponse = await stub.Generate(request, metadata=bearer(TOKEN_A))
    return reply


async def refused(stub: Stub) -> grpc.aio.AioRpcError:
    """The error of a team-a call over its max_concurrency, checked to be that one."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub)
    error = caught.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert reason(error) == "CALLER_CONCURRENCY_EXCEEDED"
    infos = [d for d in status_of(error).details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
    assert len(infos) == 1
    return error


def redis_now(client: Any) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1_000_000


def replica_of(server: RunningServer) -> str:
    assert server.core is not None and isinstance(server.core.admission.state, RedisLimits)
    return server.core.admission.state.replica


async def test_one_max_concurrency_holds_across_two_replicas(
    make_server: ServerFactory, redis_url: str
) -> None:
    one = await make_server(config(redis_url, 2))
    two = await make_server(config(redis_url, 2))
    leases = redis.Redis.from_url(redis_url)
    async with stub_of(one.address) as a, stub_of(two.address) as b:
        first, second = await hold(a), await hold(a)
        members = [m.decode() for m in leases.zrange(KEY, 0, -1)]
        assert len(members) == 2 and all(m.startswith(replica_of(one) + ":") for m in members)
        error = await refused(b)  # replica two has no call of team-a's: the limit is shared
        assert "2 calls in flight" in (error.details() or "")
        first.cancel()  # a cancelled call gives its lease back
        await until(lambda: leases.zcard(KEY) == 1, "the cancelled call's lease is gone")
        assert (await generate(b)).generations  # room again, on the other replica
        with pytest.raises(grpc.aio.AioRpcError) as bad:  # admitted, then failed: released as well
            await generate(b, n=99)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await generate(b)
        second.cancel()
        await until(lambda: leases.zcard(KEY) == 0, "every call's lease is gone")  # none leaked


async def test_a_lease_is_extended_while_its_call_runs(make_server: ServerFactory, redis_url: str) -> None:
    one = await make_server(config(redis_url, 1, state_lease_s=1.5))
    two = await make_server(config(redis_url, 1, state_lease_s=1.5))
    leases = redis.Redis.from_url(redis_url)
    async with stub_of(one.address) as a, stub_of(two.address) as b:
        call = await hold(a)
        [(member, first_expiry)] = leases.zrange(KEY, 0, -1, withscores=True)
        await until(lambda: (leases.zscore(KEY, member) or 0) > first_expiry, "the heartbeat extended it")
        await until(lambda: redis_now(leases) > first_expiry, "the lease's first expiry passed")
        await refused(b)  # the call runs on, and still counts
        call.cancel()
        await until(lambda: leases.zcard(KEY) == 0, "its lease is gone")
        assert (await generate(b)).generations


async def test_a_killed_replicas_lease_stops_counting_once_it_expires(
    make_server: ServerFactory, redis_url: str
) -> None:
    """Replica one is `gengate serve` in its own process, killed -9 with a call in flight: its
    lease is never released, and counts on replica two until it expires (state_lease_s)."""
    cfg = config(redis_url, 1, state_lease_s=3.0)
    dying = await asyncio.to_thread(ServerProcess, cfg)
    leases = redis.Redis.from_url(redis_url)
    try:
        two = await make_server(cfg)
        async with stub_of(dying.address) as a, stub_of(two.address) as b:
            await hold(a)
            [member] = [m.decode() for m in leases.zrange(KEY, 0, -1)]
            assert member.startswith(f"{socket.gethostname()}:{dying.proc.pid}:")
            await refused(b)
            dying.kill()  # the call still open: closing the channel first would end it cleanly
    finally:
        if dying.proc.returncode is None:  # the test failed before the kill
            dying.kill()
    expiry = leases.zscore(KEY, member)
    assert expiry is not None  # nobody released it
    await until(lambda: redis_now(leases) > (leases.zscore(KEY, member) or 0), "the dead one's lease expired")
    async with stub_of(two.address) as b:
        assert (await generate(b)).generations
    assert leases.zscore(KEY, member) is None  # dropped by the admission that found it expired


async def test_a_batch_item_waits_for_room_held_on_another_replica(redis_url: str) -> None:
    """A waiting admission (BatchGenerate's items) asks Redis again until the other replica's
    call ends, then is admitted: it never fails."""
    one, two = RedisLimits(redis_url), RedisLimits(redis_url)
    caller = Caller("team-a", max_concurrency=1)
    stats = redis.Redis.from_url(redis_url)

    def scripts_run() -> int:
        return int(stats.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    try:
        held = await Admission(one).admit(caller)
        before = scripts_run()
        waiting = asyncio.create_task(Admission(two).admit(caller, wait=True))
        await until(lambda: scripts_run() >= before + 2, "the waiting admission asked twice")
        assert not waiting.done()
        held.release()
        admitted = await waiting
        assert stats.zcard(KEY) == 1
        admitted.release()
        await until(lambda: stats.zcard(KEY) == 0, "both leases are gone")
    finally:
        await one.aclose()
        await two.aclose()


async def test_a_call_under_windows_and_max_concurrency_is_admitted_in_one_round_trip(redis_url: str) -> None:
    """The windows and the lease are one script: one Redis round trip to admit a call (four made a
    call cost twice what it does: bench/operations_overhead.py); a window's refusal takes no lease
    and charges nothing."""
    limits = RedisLimits(redis_url)
    caller = Caller("team-a", requests_per_minute=2, tokens_per_minute=1000, max_concurrency=5)
    stats = redis.Redis.from_url(redis_url)

    def scripts_run() -> int:
        return int(stats.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    admission = Admission(limits)
    try:
        first = await admission.admit(caller)  # the script's first run loads it into Redis
        assert stats.zcard(KEY) == 1
        before = scripts_run()
        second = await admission.admit(caller)
        assert scripts_run() - before == 1
        with pytest.raises(Exception) as refused:
            await admission.admit(caller)  # the third request in the minute
        assert getattr(refused.value, "reason", "") == "REQUEST_RATE_EXCEEDED"
        assert stats.zcard(KEY) == 2, "the refused call holds no lease"
        for admitted in (first, second):
            admitted.release()
        await until(lambda: stats.zcard(KEY) == 0, "the leases are gone")
    finally:
        await limits.aclose()


async def test_a_replica_that_loses_redis_limits_its_own_calls(
    make_server: ServerFactory, redis_server: RedisServer, redis_url: str
) -> None:
    one = await make_server(config(redis_url, 1))
    two = await make_server(config(redis_url, 1))
    redis_server.stop()
    async with stub_of(one.address) as a, stub_of(two.address) as b:
        call = await hold(a)  # served: fail-open
        await refused(a)  # this replica's own limit still holds
        assert (await generate(b)).generations  # each replica allows the whole limit
        async with grpc.aio.insecure_channel(one.address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="gengate.limits")
            )
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        call.cancel()
