"""Metrics of what happens below the router: provider retries and upstream answers, re-asks,
the compile cache of an engine in its worker process (its notes cross the IPC), GPU memory of
placed devices, the caller label; and no secret in any of it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from gengate.caller import reset_current, set_current
from gengate.callers.identity import Caller
from gengate.config import parse_config
from gengate.domain import GenerationRequest
from gengate.engines.scripted import ScriptedOptions
from gengate.metrics import ServerMetrics
from gengate.metrics.scrape import placed_gpus
from gengate.router import Router
from gengate.service import GenerationCore
from gengate.workers.backend import GpuRequest, WorkerBackend
from gengate.workers.placement import GpuInfo, NvmlDeviceProvider, PlacementFile, StaticDeviceProvider
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from metrics_scrape import parse, scrape
from observe import ServerFactory
from prometheus_client import generate_latest

sys.path.insert(0, str(Path(__file__).parent.parent / "providers"))

from fake_openai import FakeOpenAI
from fakehttp import Fault, Recorded

KEY = "Wm4kq9Zr7XbT2pLs0vNd"  # no recognisable prefix: only its absence proves nothing leaked
Stub = generation_pb2_grpc.GenerationServiceStub


class KeyedFakeOpenAI(FakeOpenAI):
    @staticmethod
    def _auth(rec: Recorded) -> bool:
        return rec.headers.get("authorization", "") == f"Bearer {KEY}"


@pytest.fixture(scope="module")
def upstream() -> Iterator[KeyedFakeOpenAI]:
    fake = KeyedFakeOpenAI()
    fake.start()
    yield fake
    fake.stop()


def _remote(fake: FakeOpenAI, name: str = "remote", key: str = KEY) -> dict[str, Any]:
    return {
        "name": name,
        "backend": "openai",
        "model": "gpt-fake",
        "base_url": fake.server.base_url + "/v1",
        "api_key": key,
        "max_retries": 1,
    }


async def test_provider_retries_upstream_answers_and_reasks_are_counted_without_secrets(
    make_server: ServerFactory, upstream: KeyedFakeOpenAI
) -> None:
    upstream.reset()
    server = await make_server(
        {
            "models": [_remote(upstream), _remote(upstream, "wrong-key", key="not-the-key-at-all-123")],
            "server": {"metrics": {"port": 0}},
        }
    )
    regex = t.StructuredOutput(regex=t.Regex(pattern=r"\d{3}-\d{4}"))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = Stub(channel)
        upstream.server.fail_next(Fault(status=429, headers={"retry-after": "0"}))
        await stub.Generate(g.GenerateRequest(model="remote", prompt="hi"))  # 429, retried, ok
        upstream.server.fail_next(Fault(status=503, headers={"retry-after": "0"}))
        frames = [
            f
            async for f in stub.GenerateStream(
                g.GenerateStreamRequest(request=g.GenerateRequest(model="remote", prompt="hi"))
            )
        ]
        assert frames[-1].WhichOneof("frame") == "end"  # a stream retried before its first event
        upstream.answers.extend(["call me maybe", "555-1234"])
        answer = await stub.Generate(g.GenerateRequest(model="remote", prompt="n", structured_output=regex))
        assert answer.generations[0].text == "555-1234"
        upstream.server.fail_next(
            Fault(status=500, headers={"retry-after": "0"}), Fault(status=500, headers={"retry-after": "0"})
        )
        with pytest.raises(grpc.aio.AioRpcError) as down:
            await stub.Generate(g.GenerateRequest(model="remote", prompt="hi"))
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(g.GenerateRequest(model="wrong-key", prompt="hi"))
        assert refused.value.code() == grpc.StatusCode.INTERNAL
    m = await scrape(server)
    retries = "gengate_provider_retries_total"
    assert m.value(retries, model="remote", reason="UPSTREAM_RATE_LIMITED") == 1
    assert m.value(retries, model="remote", reason="UPSTREAM_UNAVAILABLE") == 2  # the 503, the first 500
    assert m.value(retries, model="wrong-key") == 0  # our bad credentials are never retried
    upstream_answers = "gengate_upstream_responses_total"
    assert m.value(upstream_answers, model="remote", status="429") == 1
    assert m.value(upstream_answers, model="remote", status="503") == 1
    assert m.value(upstream_answers, model="remote", status="500") == 2
    assert m.value(upstream_answers, model="remote", status="ok") == 4  # unary, stream, the regex's two
    assert m.value(upstream_answers, model="wrong-key", status="401") == 1
    reasks = "gengate_validation_retries_total"
    assert m.value(reasks, model="remote", kind="regex", method="reask") == 1
    assert m.value(reasks, method="resample") == 0
    structured = "gengate_structured_requests_total"
    assert m.value(structured, model="remote", kind="regex", enforcement="validated") == 1
    assert m.value("gengate_requests_total", model="remote", code="OK") == 3
    assert m.value("gengate_requests_total", model="remote", code="UNAVAILABLE") == 1
    assert m.value("gengate_requests_total", model="wrong-key", code="INTERNAL") == 1
    for secret in (KEY, "not-the-key-at-all-123", "Bearer"):
        assert secret not in m.text
    assert [p for p in (KEY[i : i + 6] for i in range(len(KEY) - 5)) if p in m.text] == []
    assert upstream.server.base_url.split("//")[1] not in m.text  # nor where it lives


async def test_an_engine_workers_compile_cache_is_counted_across_the_process_boundary(
    make_server: ServerFactory,
) -> None:
    server = await make_server(
        {
            "models": [{"name": "tiny", "backend": "llamacpp", "tiny": True}],
            "server": {"metrics": {"port": 0}},
        }
    )
    assert isinstance(server.router.route("tiny").backend, WorkerBackend)
    regex = t.StructuredOutput(regex=t.Regex(pattern="(yes|no)"))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = Stub(channel)
        for _ in range(3):
            request = g.GenerateRequest(
                model="tiny",
                prompt="Answer:",
                structured_output=regex,
                stopping=t.StoppingCriteria(max_tokens=8),
            )
            answer = await stub.Generate(request)
            assert answer.generations[0].text in ("yes", "no")
    m = await scrape(server)
    assert m.value("gengate_constraint_compile_cache_total", model="tiny", result="miss") == 1
    assert m.value("gengate_constraint_compile_cache_total", model="tiny", result="hit") == 2
    assert m.value("gengate_constraint_compile_duration_seconds_count", model="tiny") == 1
    assert m.value("gengate_constraint_compile_duration_seconds_sum", model="tiny") > 0
    assert m.value("gengate_structured_requests_total", model="tiny", kind="regex", enforcement="engine") == 3


async def test_the_caller_label_is_the_current_caller() -> None:
    config = parse_config({"models": [{"name": "m", "backend": "scripted", "text": "a b"}]})
    metrics = ServerMetrics()
    router = Router.from_config(config, observer=metrics.metrics)
    await router.start_all()
    core = GenerationCore(router, observer=metrics.metrics)
    token = set_current(Caller("team-search"))
    try:
        await core.generate(GenerationRequest(model="m", prompt="x"))
        await core.generate(GenerationRequest(model="m", prompt="x"))
    finally:
        reset_current(token)
    await core.generate(GenerationRequest(model="m", prompt="x"))
    await core.aclose()
    await router.close_all()
    m = parse(generate_latest(metrics.registry).decode())
    assert m.value("gengate_requests_total", model="m", caller="team-search", code="OK") == 2
    assert m.value("gengate_requests_total", model="m", caller="anonymous", code="OK") == 1
    assert m.value("gengate_tokens_total", caller="team-search", type="output") == 4
    duration = "gen_ai_server_request_duration_seconds_count"
    assert m.value(duration, caller="team-search", gen_ai_operation_name="generate") == 2


async def test_gpu_memory_of_placed_devices_and_none_without_a_gpu(tmp_path: Path) -> None:
    """A worker placed on (fake) GPUs 1 and 3 reports their memory; with NVML and no GPU here the
    worker runs on CPU and the families stay empty; a provider that fails gives none, no error."""
    provider = StaticDeviceProvider(
        [GpuInfo(index=i, memory_total=80 << 30, memory_free=(80 - 10 * i) << 30) for i in range(4)]
    )
    placed = WorkerBackend(
        "gpu-model",
        "scripted",
        ScriptedOptions(),
        gpu=GpuRequest(devices=(1, 3), num_gpus=2),
        placement=PlacementFile(tmp_path / "placement.json"),
        device_provider=provider,
    )
    cpu = WorkerBackend(
        "cpu-model",
        "scripted",
        ScriptedOptions(),
        gpu=GpuRequest(required=False),
        placement=PlacementFile(tmp_path / "placement.json"),
    )
    await placed.start()
    await cpu.start()
    try:
        assert [(d.index, d.memory_total - d.memory_free) for d in placed_gpus(placed)] == [
            (1, 10 << 30),
            (3, 30 << 30),
        ]
        assert cpu.lease is None and placed_gpus(cpu) == []
        assert isinstance(cpu.device_provider, NvmlDeviceProvider)
        assert cpu.device_provider.unavailable_reason  # why there is none, said, not raised

        class Broken(StaticDeviceProvider):
            def list_devices(self) -> list[GpuInfo]:
                raise RuntimeError("NVML went away")

        placed._device_provider = Broken([])
        assert placed_gpus(placed) == []

        config = parse_config({"models": [{"name": "gpu-model", "backend": "scripted"}]})
        router = Router.from_config(config, factory=lambda _: placed)
        metrics = ServerMetrics()
        metrics.collector.parts.router = router
        placed._device_provider = provider
        m = parse(generate_latest(metrics.registry).decode())
        assert m.value("gengate_gpu_memory_used_bytes", model="gpu-model", gpu="3") == 30 << 30
        assert m.value("gengate_gpu_memory_total_bytes", model="gpu-model", gpu="1") == 80 << 30
        assert m.label_values("gengate_gpu_memory_used_bytes", "gpu") == {"1", "3"}
    finally:
        await placed.aclose()
        await cpu.aclose()


async def test_an_observed_stream_closed_by_its_consumer_aborts_the_model_at_once() -> None:
    """Observing a stream adds a generator around it; closing that one closes the model's
    stream now (the engine request is aborted), not when the garbage collector runs."""
    import gc

    from gengate.engines.scripted import ScriptedBackend

    config = parse_config(
        {"models": [{"name": "slow", "backend": "scripted", "text": "a b c d e f", "tokens_per_s": 20}]}
    )
    metrics = ServerMetrics()
    router = Router.from_config(config, observer=metrics.metrics)
    await router.start_all()
    core = GenerationCore(router, observer=metrics.metrics)
    backend = router.route("slow").backend
    assert isinstance(backend, ScriptedBackend)
    gc.disable()
    try:
        stream = core.generate_stream(GenerationRequest(model="slow", prompt="x"))
        await anext(stream)  # the start
        await anext(stream)  # the first token
        await stream.aclose()  # type: ignore[attr-defined]
        assert backend.cancelled == 1
    finally:
        gc.enable()
        await core.aclose()
        await router.close_all()
    m = parse(generate_latest(metrics.registry).decode())
    assert m.value("gengate_requests_total", model="slow", code="CANCELLED") == 1
    genai = {"gen_ai_request_model": "slow", "gen_ai_operation_name": "generate_stream"}
    assert m.value("gen_ai_server_time_to_first_token_seconds_count", **genai) == 1
