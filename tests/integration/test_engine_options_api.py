"""Backend options of a local engine over gRPC, on the real llama.cpp worker."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psutil
import pytest
from gengate.api.server import RunningServer
from gengate.errors import ConfigError
from gengate_client import AsyncClient
from gengate_client.errors import InvalidArgumentError
from gengate_client.types import StreamDelta

ServerFactory = Callable[[dict[str, Any]], Awaitable[RunningServer]]

pytest.importorskip("llama_cpp")


async def test_min_tokens_reaches_the_engine(make_server: ServerFactory) -> None:
    """The tiny model's random weights never pick EOS, so a stop string plays its part: one that
    matches the first token ends the call at once, unless min_tokens holds the end back."""
    server = await make_server({"models": [{"name": "tiny", "backend": "llamacpp", "tiny": True}]})
    async with AsyncClient(server.address) as client:
        (listed,) = await client.list_models()
        assert listed.capabilities.backend_options == ("ignore_eos", "min_tokens")
        plain = await client.generate("tiny", "Hi", max_tokens=40, seed=3)
        stop = plain.text[:1]
        cut = await client.generate("tiny", "Hi", max_tokens=40, seed=3, stop=[stop])
        assert cut.text == "" and cut.usage.output_tokens == 1
        held = await client.generate(
            "tiny", "Hi", max_tokens=40, seed=3, stop=[stop], backend_options={"min_tokens": 10}
        )
        assert held.usage.output_tokens > 10
        assert plain.text.startswith(held.text) and len(held.text) > 0  # same samples, cut later


async def test_a_bad_option_names_its_field_in_unary_and_batch_calls(make_server: ServerFactory) -> None:
    server = await make_server({"models": [{"name": "tiny", "backend": "llamacpp", "tiny": True}]})
    async with AsyncClient(server.address) as client:
        with pytest.raises(InvalidArgumentError) as info:
            await client.generate("tiny", "Hi", max_tokens=4, backend_options={"min_tokens": "five"})
        assert [v.field for v in info.value.field_violations] == ["backend_options[min_tokens]"]
        items = await client.batch_generate(
            [
                {"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "backend_options": {"min_tokens": 9}},
            ]
        )
        assert items[0].ok and not items[1].ok
        error = items[1].error
        assert isinstance(error, InvalidArgumentError)
        assert [v.field for v in error.field_violations] == ["requests[1].backend_options[min_tokens]"]
        assert str(error).count("requests[1].backend_options[min_tokens]: is 9, more than") == 1


async def test_a_preset_serves_a_model_with_options_fixed(make_server: ServerFactory) -> None:
    server = await make_server(
        {
            "models": [
                {"name": "tiny", "backend": "llamacpp", "tiny": True},
                {
                    "name": "tiny-long",
                    "backend": "preset",
                    "model": "tiny",
                    "backend_options": {"min_tokens": 10},
                },
            ]
        }
    )
    async with AsyncClient(server.address) as client:
        listed = {m.name: m.capabilities for m in await client.list_models()}
        assert listed["tiny-long"].backend_options == ("ignore_eos",)  # min_tokens is fixed
        assert listed["tiny-long"].max_n == listed["tiny"].max_n
        plain = await client.generate("tiny", "Hi", max_tokens=40, seed=3)
        stop = [plain.text[:1]]
        cut = await client.generate("tiny", "Hi", max_tokens=40, seed=3, stop=stop)
        held = await client.generate("tiny-long", "Hi", max_tokens=40, seed=3, stop=stop)
        assert cut.usage.output_tokens == 1 and held.usage.output_tokens > 10
        assert held.model == "tiny-long" and plain.text.startswith(held.text)
        frames = [
            f async for f in client.generate_stream("tiny-long", "Hi", max_tokens=40, seed=3, stop=stop)
        ]
        assert "".join(f.text for f in frames if isinstance(f, StreamDelta)) == held.text
        with pytest.raises(InvalidArgumentError) as info:
            await client.generate("tiny-long", "Hi", max_tokens=40, backend_options={"min_tokens": 2})
        assert [v.field for v in info.value.field_violations] == ["backend_options[min_tokens]"]


async def test_a_preset_of_an_option_its_model_does_not_take_fails_the_start(
    make_server: ServerFactory,
) -> None:
    config = {
        "models": [
            {"name": "tiny", "backend": "llamacpp", "tiny": True},
            {"name": "tiny-sql", "backend": "preset", "model": "tiny", "backend_options": {"lora": "sql"}},
        ]
    }
    with pytest.raises(
        ConfigError, match=r"'tiny-sql' \(preset\): \['lora'\] not among the backend options of 'tiny'"
    ):
        await make_server(config)
    workers = [
        p
        for p in psutil.Process().children(recursive=True)
        if "gengate.workers.main" in " ".join(p.cmdline())
    ]
    assert workers == [], "the model that did start was left running"
