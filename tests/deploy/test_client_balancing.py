"""Client-side balancing as deploy/README.md shows it: the Python client with round_robin over
several gengate servers, and gRPC's own retries waiting for the server's pushback.

A headless Service's DNS name resolves to every ready pod; here an `ipv4:` target with two
addresses stands in for that DNS answer, and the same channel options apply to both.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from gengate.api.server import SERVICE_NAME, RunningServer, start_server
from gengate.config import parse_config
from gengate_client import Client, GengateError

ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
RETRYING = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [{"service": SERVICE_NAME}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
                },
            }
        ],
    }
)

ServerFactory = Callable[[str], Awaitable[RunningServer]]


@pytest.fixture
async def servers() -> AsyncIterator[ServerFactory]:
    started: list[RunningServer] = []

    async def make(text: str) -> RunningServer:
        config = {
            "models": [
                {"name": "echo", "backend": "scripted", "text": text, "tokens_per_s": 5000},
                {
                    "name": "narrow",
                    "backend": "scripted",
                    "max_concurrency": 1,
                    "max_queue": 1,
                    "text": "a b c d e f g h",
                    "tokens_per_s": 40,
                },
            ]
        }
        server = await start_server(parse_config(config), host="127.0.0.1", port=0)
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop(grace=0.2)


def texts_from(target: str, options: list[tuple[str, Any]], calls: int) -> Counter[str]:
    with Client(target, options=options, timeout=10) as client:
        return Counter(client.generate("echo", "hi", max_tokens=4).text for _ in range(calls))


@pytest.mark.parametrize(
    "option",
    [("grpc.service_config", ROUND_ROBIN), ("grpc.lb_policy_name", "round_robin")],
    ids=["service_config", "lb_policy_name"],
)
async def test_round_robin_spreads_calls_over_every_server(
    servers: ServerFactory, option: tuple[str, str]
) -> None:
    a, b = await servers("alpha"), await servers("beta")
    target = f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}"
    spread = await asyncio.to_thread(texts_from, target, [option], 10)
    assert set(spread) == {"alpha", "beta"} and min(spread.values()) >= 4, spread
    # The default policy (pick_first) keeps every call on one server: why the option matters.
    pinned = await asyncio.to_thread(texts_from, target, [], 10)
    assert len(pinned) == 1, pinned


async def test_grpc_retries_wait_out_a_full_queue(servers: ServerFactory) -> None:
    server = await servers("alpha")

    def three_at_once(options: list[tuple[str, Any]], max_retries: int | None = None) -> list[str]:
        with Client(server.address, options=options, timeout=10, max_retries=max_retries) as client:

            async def one() -> str:
                try:
                    return await asyncio.to_thread(lambda: client.generate("narrow", "x").text)
                except GengateError as exc:
                    return exc.code_name

            async def all_three() -> list[str]:
                return list(await asyncio.gather(one(), one(), one()))

            return asyncio.run(all_three())

    without = await asyncio.to_thread(three_at_once, [], 0)
    assert without.count("RESOURCE_EXHAUSTED") == 1, without
    # The client's own retry policy (the default) waits the server's grpc-retry-pushback-ms
    # (1000 ms, far longer than the policy's 0.2 s first backoff) and then succeeds.
    started = time.monotonic()
    retried = await asyncio.to_thread(three_at_once, [])
    assert retried == ["a b c d e f g h"] * 3, retried
    assert time.monotonic() - started >= 0.95
    # A service config of the caller's own (here: a mesh's policy) replaces the client's.
    own = await asyncio.to_thread(
        three_at_once, [("grpc.service_config", RETRYING), ("grpc.enable_retries", 1)]
    )
    assert own == ["a b c d e f g h"] * 3, own
