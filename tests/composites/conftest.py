"""Composite tests: the test member kind registered, a service core or a real server from a config."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from composite_members import KIND, TARGET, CoreFactory, ServerFactory
from gengate import registry
from gengate.api.server import RunningServer, start_server
from gengate.config import parse_config
from gengate.router import Router
from gengate.service import GenerationCore


@pytest.fixture(autouse=True)
def member_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.KINDS, KIND, registry.KindSpec(KIND, TARGET, "engine"))


@pytest.fixture
async def make_core() -> AsyncIterator[CoreFactory]:
    """Service cores (router started) from `models:` lists; closed at the end of the test."""
    routers: list[Router] = []

    async def make(models: list[dict[str, Any]]) -> GenerationCore:
        router = Router.from_config(parse_config({"models": models}))
        routers.append(router)
        await router.start_all()
        return GenerationCore(router)

    yield make
    for router in routers:
        await router.close_all()


@pytest.fixture
async def make_server() -> AsyncIterator[ServerFactory]:
    """Real gRPC servers on port 0 from `models:` lists; stopped at the end of the test."""
    started: list[RunningServer] = []

    async def make(models: list[dict[str, Any]]) -> RunningServer:
        server = await start_server(parse_config({"models": models}), host="127.0.0.1", port=0)
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop(grace=0.5)
