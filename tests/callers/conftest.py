"""The teams' tokens are in the environment of every test here; the shared-state tests' real
redis-server (one per module, a database emptied for each test)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_server import RedisServer, Unavailable
from teams import TOKENS


@pytest.fixture(autouse=True)
def team_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable, token in TOKENS.items():
        monkeypatch.setenv(variable, token)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    try:
        server = RedisServer()
        server.start()
    except Unavailable as exc:
        pytest.skip(f"no redis-server: {exc}")
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The server's URL, on a database emptied for each test (and running again if one stopped it)."""
    if redis_server.proc is None:
        redis_server.start()
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    yield redis_server.url
