"""README: "two workers — even in two servers on one node — never take the same GPU unless told
to", at the server level: a real server started from config, its models' workers placed on a
node whose GPUs a fake NVML lists (no GPU here), the node-wide placement file in a temp dir."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from gengate.workers import factory, placement
from gengate.workers.placement import PlacementError, PlacementFile, StaticDeviceProvider
from gengate_client import AsyncClient
from observe import ServerFactory


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> PlacementFile:
    """A node with two GPUs of equal free memory; the placement file every server here shares."""
    shared = PlacementFile(tmp_path / "placement.json")
    monkeypatch.setattr(factory, "_shared_placement", shared)
    monkeypatch.setattr(placement, "NvmlDeviceProvider", lambda: StaticDeviceProvider.fake(2))
    return shared


def gpu_model(name: str, **keys: object) -> dict[str, object]:
    return {
        "name": name,
        "backend": "scripted",
        "text": "one two three",
        "isolation": "process",
        "devices": "auto",
        **keys,
    }


async def test_models_of_one_server_get_gpus_of_their_own(
    make_server: ServerFactory, node: PlacementFile
) -> None:
    server = await make_server({"models": [gpu_model("a"), gpu_model("b")]})
    held = {lease.model: lease.devices for lease in node.leases()}
    assert set(held) == {"a", "b"} and set(held["a"]).isdisjoint(held["b"]), held
    async with AsyncClient(server.address) as client:
        for model in ("a", "b"):
            assert (await client.generate(model, "hi", max_tokens=2)).usage.output_tokens == 2


async def test_a_model_that_finds_every_gpu_taken_stops_the_start(
    make_server: ServerFactory, node: PlacementFile
) -> None:
    first = await make_server({"models": [gpu_model("a", num_gpus=2)]})
    assert [lease.devices for lease in node.leases()] == [(0, 1)]
    # a second server on the node (same placement file): nothing is free for it
    with pytest.raises(PlacementError) as caught:
        await make_server({"models": [gpu_model("b")]})
    assert "b" not in {lease.model for lease in node.leases()}
    assert "GPU" in str(caught.value)
    async with AsyncClient(first.address) as client:  # the first server is untouched
        assert (await client.generate("a", "hi", max_tokens=1)).usage.output_tokens == 1


async def test_share_devices_lets_them_share_and_says_so(
    make_server: ServerFactory, node: PlacementFile, caplog: pytest.LogCaptureFixture
) -> None:
    await make_server({"models": [gpu_model("a", num_gpus=2)]})
    with caplog.at_level(logging.WARNING):
        await make_server({"models": [gpu_model("b", share_devices=True)]})
    held = {lease.model: lease.devices for lease in node.leases()}
    assert set(held["b"]) <= set(held["a"])
    shared = [r.getMessage() for r in caplog.records if "shares GPU" in r.getMessage()]
    assert shared and "model 'b'" in shared[0], [r.getMessage() for r in caplog.records]
