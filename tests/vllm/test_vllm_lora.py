"""LoRA adapters on the vLLM engine: a request picks one with backend_options {lora: name}."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from gengate import errors
from gengate.api.server import RunningServer, start_server
from gengate.config import parse_config
from gengate.domain import GenerationRequest, SamplingParams, StoppingCriteria
from gengate.engines.vllm import VLLM_SAMPLING_OPTIONS
from gengate.models.tiny import TINY_VLLM, build_tiny_lora
from gengate.workers.backend import WorkerBackend, WorkerStartError
from gengate.workers.factory import build_backend

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
async def lora_server(
    vllm_entry: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningServer]:
    """A gengate server with the vLLM model and two adapters, one also served as a preset."""
    folder = tmp_path_factory.mktemp("lora")
    adapters = {
        "bold": str(build_tiny_lora(folder / "bold", config=TINY_VLLM, seed=1)),
        "calm": str(build_tiny_lora(folder / "calm", config=TINY_VLLM, seed=2)),
    }
    entry = {**vllm_entry, "lora_adapters": adapters, "max_lora_rank": 8, "max_loras": 2}
    preset = {
        "name": "small-bold",
        "backend": "preset",
        "model": "small",
        "backend_options": {"lora": "bold"},
    }
    server = await start_server(parse_config({"models": [entry, preset]}), host="127.0.0.1", port=0)
    yield server
    await server.stop(grace=1)


@pytest.fixture(scope="module")
def vllm_lora(lora_server: RunningServer) -> WorkerBackend:
    backend = lora_server.router.route("small").backend
    assert isinstance(backend, WorkerBackend)
    return backend


def req(**kwargs: object) -> GenerationRequest:
    base: dict[str, object] = {
        "model": "small",
        "prompt": "Once upon a time",
        "sampling": SamplingParams(temperature=0.0),
        "stopping": StoppingCriteria(max_tokens=24),
    }
    base.update(kwargs)
    return GenerationRequest(**base)  # type: ignore[arg-type]


async def text(backend: WorkerBackend, **kwargs: object) -> str:
    return (await backend.generate(req(**kwargs))).generations[0].text


async def test_each_adapter_changes_the_output_and_the_base_is_unchanged(vllm_lora: WorkerBackend) -> None:
    expected = {"min_tokens", "ignore_eos", "lora", *VLLM_SAMPLING_OPTIONS}
    assert vllm_lora.capabilities.backend_options == expected
    base = await text(vllm_lora)
    bold = await text(vllm_lora, backend_options={"lora": "bold"})
    calm = await text(vllm_lora, backend_options={"lora": "calm"})
    assert len({base, bold, calm}) == 3, (base, bold, calm)
    # greedy: each is reproducible, and adapters do not leak into other requests
    assert await text(vllm_lora, backend_options={"lora": "bold"}) == bold
    assert await text(vllm_lora) == base


async def test_requests_for_different_adapters_batch_together(vllm_lora: WorkerBackend) -> None:
    import asyncio

    def options(name: str) -> dict[str, object]:
        return {"backend_options": {"lora": name}} if name else {}

    names = ["", "bold", "calm"] * 4
    alone = {name: await text(vllm_lora, **options(name)) for name in set(names)}
    together = await asyncio.gather(*(text(vllm_lora, **options(name)) for name in names))
    assert together == [alone[name] for name in names]


async def test_an_unknown_adapter_is_refused_with_the_known_ones(vllm_lora: WorkerBackend) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        await vllm_lora.generate(req(backend_options={"lora": "loud"}))
    assert [v.field for v in info.value.violations] == ["backend_options[lora]"]
    assert "no adapter 'loud' on this model (adapters: bold, calm)" in info.value.message


async def test_an_adapter_that_does_not_load_fails_the_start(
    vllm_entry: dict[str, Any], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')  # and no weights
    entry = {**vllm_entry, "lora_adapters": {"broken": str(broken)}, "max_lora_rank": 8}
    backend = build_backend(parse_config({"models": [entry]}).models[0])
    assert isinstance(backend, WorkerBackend)
    with pytest.raises(WorkerStartError, match="broken"):
        await backend.start()
    await backend.aclose()


async def test_an_adapter_served_as_a_preset_model_over_grpc(
    lora_server: RunningServer, vllm_lora: WorkerBackend
) -> None:
    from gengate_client import AsyncClient

    async with AsyncClient(lora_server.address) as client:
        listed = {m.name: m.capabilities.backend_options for m in await client.list_models()}
        assert listed == {
            "small": tuple(sorted({"ignore_eos", "lora", "min_tokens", *VLLM_SAMPLING_OPTIONS})),
            "small-bold": tuple(sorted({"ignore_eos", "min_tokens", *VLLM_SAMPLING_OPTIONS})),
        }
        reply = await client.generate("small-bold", "Once upon a time", max_tokens=24, temperature=0.0)
    assert reply.model == "small-bold"
    assert reply.text == await text(vllm_lora, backend_options={"lora": "bold"})
    assert reply.text != await text(vllm_lora)
