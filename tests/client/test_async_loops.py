"""AsyncClient makes its channel in the event loop that uses it: a client built where no loop runs
(module level) works under `asyncio.run`, again under a second `asyncio.run`, and through the
Outlines adapter, as the openai SDK's AsyncOpenAI does."""

from __future__ import annotations

import asyncio

import pytest
from fake_gengate import RunningFake
from gengate_client import AsyncClient
from pydantic import BaseModel


def test_a_client_made_outside_any_loop_serves_one_loop_after_another(fake: RunningFake) -> None:
    client = AsyncClient(fake.address)  # as at module level: no loop is running

    async def ask(prompt: str) -> str:
        return (await client.generate("tiny", prompt)).text

    assert asyncio.run(ask("p q")) == "echo 0: p q"
    assert asyncio.run(ask("r s")) == "echo 0: r s"  # a new loop: the channel is made again in it

    async def models_then_close() -> int:
        count = len(await client.list_models())
        await client.close()
        return count

    assert asyncio.run(models_then_close()) > 0
    assert asyncio.run(ask("t u")) == "echo 0: t u"  # usable after close, as a new channel
    asyncio.run(client.close())
    prompts = [r.prompt for r in fake.servicer.requests if hasattr(r, "prompt") and r.prompt]
    assert prompts == ["p q", "r s", "t u"]


def test_outlines_on_a_module_level_async_client(fake: RunningFake) -> None:
    outlines = pytest.importorskip("outlines")
    from gengate_client.outlines import from_gengate

    class City(BaseModel):
        name: str

    model = from_gengate(AsyncClient(fake.address), "tiny")
    for _ in range(2):
        text = asyncio.run(outlines.Generator(model, City)("Describe a city"))
        assert City.model_validate_json(text).name == "Paris"
