"""Prometheus metrics of a real server: calls over gRPC, then the endpoint scraped over HTTP and
parsed with prometheus_client's parser; every count checked against the calls made."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Any

import grpc
import pytest
from gengate.errors import ConfigError
from gengate.workers.backend import WorkerBackend
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from metrics_scrape import parse, scrape, scrape_text
from observe import ServerFactory, until

ANON = "anonymous"
Stub = generation_pb2_grpc.GenerationServiceStub


def with_metrics(*models: dict[str, Any], **server: Any) -> dict[str, Any]:
    return {"models": list(models), "server": {"metrics": {"port": 0}, **server}}


async def test_requests_tokens_and_durations_count_the_calls_made(make_server: ServerFactory) -> None:
    server = await make_server(with_metrics({"name": "m", "backend": "scripted", "text": "one two three"}))
    usage = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = Stub(channel)
        for prompt in ("a", "b c", "d e f"):
            response = await stub.Generate(g.GenerateRequest(model="m", prompt=prompt))
            usage.append((response.usage.input_tokens, response.usage.output_tokens))
        with pytest.raises(grpc.aio.AioRpcError) as bad:  # n over the model's max_n: checked, refused
            await stub.Generate(g.GenerateRequest(model="m", prompt="x", n=99))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Generate(g.GenerateRequest(model="no-such-model", prompt="x"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    m = await scrape(server)
    assert m.value("gengate_requests_total", model="m", caller=ANON, code="OK") == 3
    assert m.value("gengate_requests_total", model="m", caller=ANON, code="INVALID_ARGUMENT") == 1
    assert m.value("gengate_requests_total", model="", code="NOT_FOUND") == 1  # not a label per bad name
    assert "no-such-model" not in m.text
    assert m.value("gengate_requests_total") == 5
    assert m.value("gengate_tokens_total", model="m", caller=ANON, type="input") == sum(i for i, _ in usage)
    assert m.value("gengate_tokens_total", model="m", caller=ANON, type="output") == sum(o for _, o in usage)
    assert m.value("gengate_tokens_total", model="m", type="cached") == 0
    genai = {"gen_ai_request_model": "m", "gen_ai_operation_name": "generate", "caller": ANON}
    duration = "gen_ai_server_request_duration_seconds_count"
    assert m.value(duration, **genai, error_type="") == 3
    assert m.value(duration, **genai, error_type="INVALID_ARGUMENT") == 1
    assert m.types["gen_ai_server_request_duration_seconds"] == "histogram"
    usage_count = "gen_ai_client_token_usage_tokens_count"
    assert m.value(usage_count, **genai, gen_ai_token_type="input") == 3  # successful requests only
    assert m.value("gen_ai_client_token_usage_tokens_sum", **genai, gen_ai_token_type="output") == sum(
        o for _, o in usage
    )
    assert m.value("gen_ai_server_time_to_first_token_seconds_count") == 0  # streams only
    assert m.value("gengate_model_info", model="m", backend="scripted") == 1
    assert m.value("gengate_model_max_concurrency", model="m") == 64
    assert m.value("gengate_model_serving", model="m") == 1
    assert m.value("process_resident_memory_bytes") > 0


async def test_a_request_refused_before_conversion_is_counted(make_server: ServerFactory) -> None:
    """Requests the servicer refuses while converting them (never reaching the core) are counted
    with their code, operation and duration, under their model only when it is served."""
    server = await make_server(with_metrics({"name": "m", "backend": "scripted"}))
    not_json = t.StructuredOutput(json_schema=t.JsonSchema(name="x", schema_json="{not json"))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = Stub(channel)
        for model in ("m", "m", "elsewhere"):
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.Generate(g.GenerateRequest(model=model, prompt="x", structured_output=not_json))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stream = stub.GenerateStream(
            g.GenerateStreamRequest(
                request=g.GenerateRequest(model="m", prompt="x", structured_output=not_json)
            )
        )
        with pytest.raises(grpc.aio.AioRpcError):
            await stream.read()
    m = await scrape(server)
    assert m.value("gengate_requests_total", model="m", caller=ANON, code="INVALID_ARGUMENT") == 3
    assert m.value("gengate_requests_total", model="", caller=ANON, code="INVALID_ARGUMENT") == 1
    assert "elsewhere" not in m.text
    duration = "gen_ai_server_request_duration_seconds_count"
    for operation, count in (("generate", 2), ("generate_stream", 1)):
        labels = {"gen_ai_request_model": "m", "gen_ai_operation_name": operation, "caller": ANON}
        assert m.value(duration, **labels, error_type="INVALID_ARGUMENT") == count, operation


async def test_a_stream_records_time_to_first_token_and_per_output_token(make_server: ServerFactory) -> None:
    server = await make_server(
        with_metrics({"name": "s", "backend": "scripted", "text": "w1 w2 w3 w4", "tokens_per_s": 500})
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        frames = [
            f
            async for f in Stub(channel).GenerateStream(
                g.GenerateStreamRequest(request=g.GenerateRequest(model="s", prompt="p q", n=2))
            )
        ]
    ends = [f.end for f in frames if f.WhichOneof("frame") == "end"]
    assert len(ends) == 2
    m = await scrape(server)
    genai = {"gen_ai_request_model": "s", "gen_ai_operation_name": "generate_stream", "caller": ANON}
    assert m.value("gen_ai_server_time_to_first_token_seconds_count", **genai) == 1
    assert m.value("gen_ai_server_time_to_first_token_seconds_sum", **genai) > 0
    assert m.value("gen_ai_server_time_per_output_token_seconds_count", **genai) == 2  # one per generation
    assert m.value("gen_ai_server_request_duration_seconds_count", **genai, error_type="") == 1
    assert m.value("gengate_requests_total", model="s", code="OK") == 1
    output = sum(e.usage.output_tokens for e in ends)
    assert output == 8
    assert m.value("gengate_tokens_total", model="s", type="output") == output
    assert m.value("gengate_tokens_total", model="s", type="input") == 2  # the prompt once, not n times
    assert m.value("gengate_tokens_total", model="s", type="cached") == 0  # nothing came from a cache


async def test_a_structured_stream_refused_before_its_start_counts_the_declared_enforcement(
    make_server: ServerFactory,
) -> None:
    # The model refuses before it sends a start frame (which would say how it enforces): the count
    # takes the enforcement the model declares.
    model = {"name": "v", "backend": "scripted", "constraints": {"regex": "validated"}, "rate_limit_every": 1}
    server = await make_server(with_metrics(model))
    request = g.GenerateRequest(
        model="v", prompt="x", structured_output=t.StructuredOutput(regex=t.Regex(pattern="[a-c]+"))
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in Stub(channel).GenerateStream(g.GenerateStreamRequest(request=request)):
                pass
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    m = await scrape(server)
    structured = "gengate_structured_requests_total"
    assert m.value(structured, model="v", kind="regex", enforcement="validated") == 1
    assert m.value(structured, model="v", kind="regex") == 1


async def test_structured_requests_count_kind_enforcement_and_validation_failures(
    make_server: ServerFactory,
) -> None:
    server = await make_server(
        with_metrics(
            {"name": "v", "backend": "scripted", "text": "abc", "constraints": {"regex": "validated"}},
            {"name": "e", "backend": "scripted", "text": "maybe", "constraints": {"choice": "engine"}},
        )
    )
    regex = t.StructuredOutput(regex=t.Regex(pattern="[a-c]+"))
    wrong = t.StructuredOutput(regex=t.Regex(pattern="[x-z]+"))
    choice = t.StructuredOutput(choice=t.Choice(choices=["yes", "no"]))
    codes = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = Stub(channel)
        for model, structured in (("v", regex), ("v", regex), ("v", wrong), ("e", choice)):
            try:
                await stub.Generate(g.GenerateRequest(model=model, prompt="x", structured_output=structured))
                codes.append("OK")
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code().name)
    assert codes == ["OK", "OK", "ABORTED", "INTERNAL"]  # the server's validation caught both lies
    m = await scrape(server)
    assert m.value("gengate_structured_requests_total", model="v", kind="regex", enforcement="validated") == 3
    assert m.value("gengate_structured_requests_total", model="e", kind="choice", enforcement="engine") == 1
    failures = "gengate_validation_failures_total"
    assert m.value(failures, model="v", kind="regex", enforcement="validated") == 1
    assert m.value(failures, model="e", kind="choice", enforcement="engine") == 1
    assert m.value("gengate_requests_total", model="v", code="ABORTED") == 1
    assert m.value("gengate_requests_total", model="e", code="INTERNAL") == 1
    assert m.value("gengate_constraint_checks_total", result="checked") >= 2  # each new constraint once
    assert m.value("gengate_constraint_checks_total", result="cached") >= 1  # the repeated regex


async def test_tool_requests_count_as_kind_tools_with_their_validation_failures(
    make_server: ServerFactory,
) -> None:
    call = {"name": "f", "arguments": {}}
    server = await make_server(
        with_metrics(
            {"name": "ok", "backend": "scripted", "tool_calls": [call]},
            {
                "name": "bad",
                "backend": "scripted",
                "tool_calls": [{"name": "g"}],
                "tools_enforcement": "native",
            },
        )
    )
    codes = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = Stub(channel)
        for model in ("ok", "ok", "bad"):
            try:
                await stub.Generate(g.GenerateRequest(model=model, prompt="x", tools=[t.Tool(name="f")]))
                codes.append("OK")
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code().name)
        await stub.Generate(g.GenerateRequest(model="ok", prompt="no tools"))  # not counted as tools
    assert codes == ["OK", "OK", "ABORTED"]
    m = await scrape(server)
    structured = "gengate_structured_requests_total"
    assert m.value(structured, model="ok", kind="tools", enforcement="validated") == 2
    assert m.value(structured, model="bad", kind="tools", enforcement="native") == 1
    assert m.value("gengate_validation_failures_total", model="bad", kind="tools", enforcement="native") == 1


async def test_batch_generate_counts_each_item(make_server: ServerFactory) -> None:
    server = await make_server(with_metrics({"name": "b", "backend": "scripted", "text": "x y"}))
    async with grpc.aio.insecure_channel(server.address) as channel:
        items = [
            g.GenerateRequest(model="b", prompt="one"),
            g.GenerateRequest(model="b", prompt="two"),
            g.GenerateRequest(model="b", prompt="three", n=99),
            g.GenerateRequest(model="b", prompt="four", sampling=t.SamplingParams(temperature=float("nan"))),
        ]
        answers = [a async for a in Stub(channel).BatchGenerate(g.BatchGenerateRequest(requests=items))]
    assert sorted(a.WhichOneof("result") for a in answers) == ["error", "error", "response", "response"]
    m = await scrape(server)
    genai = {"gen_ai_request_model": "b", "gen_ai_operation_name": "batch_generate", "caller": ANON}
    assert m.value("gen_ai_server_request_duration_seconds_count", **genai) == 4
    assert m.value("gengate_requests_total", model="b", code="OK") == 2
    assert m.value("gengate_requests_total", model="b", code="INVALID_ARGUMENT") == 2
    assert m.value("gengate_tokens_total", model="b", type="output") == 4


async def test_in_flight_and_queued_calls_are_gauges_read_at_scrape_time(make_server: ServerFactory) -> None:
    server = await make_server(
        with_metrics(
            {"name": "slow", "backend": "scripted", "text": "a", "latency_s": 600, "max_concurrency": 1}
        )
    )
    route = server.router.route("slow")
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = Stub(channel)
        request = g.GenerateRequest(model="slow", prompt="p")
        calls = [asyncio.ensure_future(stub.Generate(request)) for _ in "ab"]
        await until(lambda: route.in_flight == 1 and route.waiting == 1, "one call runs, one waits")
        m = await scrape(server)
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await until(lambda: route.in_flight == 0 and route.waiting == 0, "both calls are gone")
    assert m.value("gengate_in_flight_requests", model="slow", priority="interactive") == 1
    assert m.value("gengate_in_flight_requests", model="slow", priority="background") == 0
    assert m.value("gengate_queued_requests", model="slow", priority="interactive") == 1
    assert m.types["gengate_in_flight_requests"] == "gauge"
    after = await scrape(server)
    assert after.value("gengate_in_flight_requests", model="slow") == 0
    assert after.value("gengate_queued_requests", model="slow") == 0
    address = server.metrics_address
    assert address is not None
    await until(
        lambda: (
            parse(scrape_text(address)).value("gengate_requests_total", model="slow", code="CANCELLED") == 2
        ),
        "both cancellations are observed",
    )


async def test_a_killed_worker_counts_a_restart(make_server: ServerFactory) -> None:
    server = await make_server(
        with_metrics({"name": "w", "backend": "scripted", "isolation": "process", "text": "a b"})
    )
    backend = server.router.route("w").backend
    assert isinstance(backend, WorkerBackend)
    before = await scrape(server)
    assert before.value("gengate_worker_restarts_total", model="w") == 0
    assert before.value("gengate_model_serving", model="w") == 1
    pid = backend.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await until(lambda: not backend.serving, "the worker's death is noticed")
    await until(lambda: backend.serving and backend.restarts == 1, "the worker is back")
    after = await scrape(server)
    assert after.value("gengate_worker_restarts_total", model="w") == 1
    assert after.value("gengate_model_serving", model="w") == 1
    # No GPU was placed (none here): the GPU families have no series, and the scrape works.
    assert after.values("gengate_gpu_memory_used_bytes") == []
    assert after.values("gengate_gpu_memory_total_bytes") == []


async def test_batch_job_items_are_counted_by_state(make_server: ServerFactory) -> None:
    from gengate_proto.v1 import jobs_pb2, jobs_pb2_grpc

    server = await make_server(with_metrics({"name": "j", "backend": "scripted", "text": "ok"}))
    async with grpc.aio.insecure_channel(server.address) as channel:
        jobs = jobs_pb2_grpc.BatchJobServiceStub(channel)
        job = await jobs.CreateBatchJob(
            jobs_pb2.CreateBatchJobRequest(
                requests=[
                    g.GenerateRequest(model="j", prompt="a"),
                    g.GenerateRequest(model="j", prompt="b"),
                    g.GenerateRequest(model="j", prompt="c", n=99),
                ]
            )
        )
        assert job.job.id
    runner = server.jobs
    assert runner is not None
    await until(lambda: runner.finished_items == 3, "every item is stored")
    m = await scrape(server)
    assert m.value("gengate_batch_job_items_total", state="succeeded") == 2
    assert m.value("gengate_batch_job_items_total", state="failed") == 1
    assert m.value("gengate_batch_job_items_current", state="running") == 0
    genai = {"gen_ai_request_model": "j", "gen_ai_operation_name": "batch_job"}
    assert m.value("gen_ai_server_request_duration_seconds_count", **genai) == 3
    assert m.value("gengate_requests_total", model="j", code="OK") == 2


async def test_two_servers_in_one_process_keep_their_own_counts(make_server: ServerFactory) -> None:
    one = await make_server(with_metrics({"name": "m", "backend": "scripted", "text": "a"}))
    two = await make_server(with_metrics({"name": "m", "backend": "scripted", "text": "a"}))
    assert one.metrics_address != two.metrics_address
    async with grpc.aio.insecure_channel(one.address) as channel:
        for _ in range(3):
            await Stub(channel).Generate(g.GenerateRequest(model="m", prompt="p"))
    assert (await scrape(one)).value("gengate_requests_total", model="m") == 3
    assert (await scrape(two)).value("gengate_requests_total", model="m") == 0


async def test_metrics_are_off_unless_configured(make_server: ServerFactory) -> None:
    server = await make_server({"models": [{"name": "m", "backend": "scripted"}]})
    assert server.metrics is None and server.metrics_address is None
    assert server.core is not None and server.core.observer is None
    assert all(route.observer is None for route in server.router.routes)


async def test_a_metrics_port_in_use_fails_the_start_naming_it(make_server: ServerFactory) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            await make_server(
                {"models": [{"name": "m", "backend": "scripted"}], "server": {"metrics": {"port": port}}}
            )


def test_metrics_settings_are_checked() -> None:
    from gengate.config import parse_config

    models = [{"name": "m", "backend": "scripted"}]
    config = parse_config({"models": models, "server": {"metrics": {"port": 9464, "host": "0.0.0.0"}}})
    assert (config.server.metrics.port, config.server.metrics.host) == (9464, "0.0.0.0")
    assert parse_config({"models": models}).server.metrics.port is None
    with pytest.raises(ConfigError, match=r"server: metrics\.path: unknown key"):
        parse_config({"models": models, "server": {"metrics": {"port": 1, "path": "/m"}}})
    with pytest.raises(ConfigError, match="gRPC port"):
        parse_config({"models": models, "server": {"port": 9000, "metrics": {"port": 9000}}})
    with pytest.raises(ConfigError, match=r"metrics\.port"):
        parse_config({"models": models, "server": {"metrics": {"port": 70000}}})


def test_every_family_has_help_and_a_known_type() -> None:
    from gengate.metrics import ServerMetrics
    from prometheus_client import generate_latest

    text = generate_latest(ServerMetrics().registry).decode()
    assert parse(text).samples  # the process's own, before any call
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            assert line.split()[3] in ("counter", "gauge", "histogram"), line
    assert text.count("# HELP gen_ai_") == 4


async def test_the_catalogue_is_what_a_server_exports(make_server: ServerFactory) -> None:
    """gengate.metrics.catalogue(), which the README, dashboard and alerts are checked against,
    lists exactly the gengate families a live server writes (types and labels included)."""
    from gengate.metrics import catalogue

    server = await make_server(
        with_metrics({"name": "m", "backend": "scripted", "isolation": "process", "text": "a"})
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        await Stub(channel).Generate(g.GenerateRequest(model="m", prompt="p"))
    m = await scrape(server)
    ours = {name: kind for name, kind in m.types.items() if not name.startswith("process_")}
    listed = catalogue()
    assert ours == {name: kind for name, (kind, _) in listed.items() if not name.startswith("process_")}
    assert {name for name in listed if name.startswith("process_")} <= set(m.types)
    suffixes = ("", "_total", "_bucket", "_sum", "_count")
    for sample in m.samples:
        family = next((n for n in listed for x in suffixes if sample.name == n + x), None)
        if family is None:
            assert sample.name.startswith("process_"), sample.name  # the process collector's others
            continue
        labels = set(listed[family][1]) | ({"le"} if sample.name.endswith("_bucket") else set())
        assert set(sample.labels) == labels, sample.name


async def test_a_price_table_counts_what_each_caller_spent_per_model(make_server: ServerFactory) -> None:
    prices = {"priced": {"input_per_million": 2.0, "output_per_million": 10.0}}
    server = await make_server(
        with_metrics(
            {"name": "priced", "backend": "scripted", "text": "one two three"},
            {"name": "free", "backend": "scripted", "text": "one two"},
            metrics={"port": 0, "prices": prices},
        )
    )
    spent = 0.0
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = Stub(channel)
        for prompt in ("a b", "c d e f"):
            usage = (await stub.Generate(g.GenerateRequest(model="priced", prompt=prompt))).usage
            spent += (usage.input_tokens * 2.0 + usage.output_tokens * 10.0) / 1_000_000
        await stub.Generate(g.GenerateRequest(model="free", prompt="x"))
        with pytest.raises(grpc.aio.AioRpcError):  # a refused request costs nothing
            await stub.Generate(g.GenerateRequest(model="priced", prompt="x", n=99))
    m = await scrape(server)
    assert m.value("gengate_cost_total", model="priced", caller=ANON) == pytest.approx(spent)
    assert spent > 0
    assert 'gengate_cost_total{caller="anonymous",model="free"}' not in m.text


def test_prices_are_checked() -> None:
    from gengate.config import ModelPrice, parse_config

    models = [{"name": "m", "backend": "scripted"}]
    with pytest.raises(ConfigError, match=r"not configured: \['gpt'\]"):
        parse_config(
            {
                "models": models,
                "server": {"metrics": {"prices": {"gpt": {"input_per_million": 1, "output_per_million": 1}}}},
            }
        )
    with pytest.raises(ConfigError, match="input_per_million"):
        parse_config(
            {
                "models": models,
                "server": {"metrics": {"prices": {"m": {"input_per_million": -1, "output_per_million": 1}}}},
            }
        )
    cached = ModelPrice(input_per_million=4.0, output_per_million=0.0, cached_input_per_million=1.0)
    assert cached.cost(input_tokens=1_000_000, output_tokens=0, cached_input_tokens=500_000) == pytest.approx(
        2.5
    )
