"""Bad input gets a precise status with details, and the server goes on serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from observe import ServerFactory, until


def details(error: grpc.aio.AioRpcError) -> tuple[error_details_pb2.ErrorInfo, list[tuple[str, str]]]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status in trailers"
    info = error_details_pb2.ErrorInfo()
    violations: list[tuple[str, str]] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
    return info, violations


async def call_error(
    stub: generation_pb2_grpc.GenerationServiceStub, request: g.GenerateRequest
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(request)
    return caught.value


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (g.GenerateRequest(model="echo"), grpc.StatusCode.INVALID_ARGUMENT, "input"),
        (g.GenerateRequest(prompt="x"), grpc.StatusCode.INVALID_ARGUMENT, "model"),
        (g.GenerateRequest(model="echo", prompt="x", n=0), grpc.StatusCode.INVALID_ARGUMENT, "n"),
        (g.GenerateRequest(model="echo", prompt="x", n=17), grpc.StatusCode.INVALID_ARGUMENT, "n"),
        (
            g.GenerateRequest(model="echo", prompt="x", stopping=t.StoppingCriteria(max_tokens=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "stopping.max_tokens",
        ),
        (
            g.GenerateRequest(model="echo", prompt="x", sampling=t.SamplingParams(temperature=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.temperature",
        ),
        (
            g.GenerateRequest(model="echo", prompt="x", sampling=t.SamplingParams(top_p=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.top_p",
        ),
        (
            g.GenerateRequest(model="echo", prompt="x", stopping=t.StoppingCriteria(stop=[""])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "stopping.stop[0]",
        ),
        (
            g.GenerateRequest(model="echo", messages=t.ChatMessages()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "messages.messages",
        ),
        (
            g.GenerateRequest(
                model="echo",
                messages=t.ChatMessages(messages=[t.ChatMessage(content=[t.ContentPart(text="hi")])]),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "messages.messages[0].role",
        ),
        (
            g.GenerateRequest(
                model="echo",
                messages=t.ChatMessages(
                    messages=[
                        t.ChatMessage(
                            role=t.ROLE_USER, content=[t.ContentPart(image=t.Image(url="http://x/y.png"))]
                        )
                    ]
                ),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "messages.messages[0].content[0].image",
        ),
        (
            g.GenerateRequest(
                model="echo",
                prompt="x",
                backend_options={"frobnicate": t.BackendOptionValue(bool_value=True)},
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "backend_options[frobnicate]",
        ),
        (
            g.GenerateRequest(
                model="echo", prompt="x", structured_output=t.StructuredOutput(choice=t.Choice(choices=["a"]))
            ),
            grpc.StatusCode.UNIMPLEMENTED,
            "structured_output.choice",
        ),
        (
            g.GenerateRequest(model="echo", prompt="x", structured_output=t.StructuredOutput()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "structured_output.kind",
        ),
    ],
)
async def test_bad_request_names_the_field(
    stub: generation_pb2_grpc.GenerationServiceStub,
    request_: g.GenerateRequest,
    code: grpc.StatusCode,
    field: str,
) -> None:
    error = await call_error(stub, request_)
    assert error.code() == code, error.details()
    info, violations = details(error)
    assert info.domain == "gengate.dev" and info.reason
    assert field in [v[0] for v in violations], violations
    # the server still serves afterwards
    ok = await stub.Generate(g.GenerateRequest(model="echo", prompt="still here"))
    assert ok.generations[0].text == "still here"


async def test_unknown_model_is_not_found_with_reason(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    error = await call_error(stub, g.GenerateRequest(model="gpt-17", prompt="x"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    info, _ = details(error)
    assert info.reason == "MODEL_NOT_FOUND" and info.metadata["model"] == "gpt-17"
    assert "echo" in (error.details() or "")


async def test_all_violations_are_reported_at_once(stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    error = await call_error(
        stub,
        g.GenerateRequest(
            model="echo",
            prompt="x",
            n=99,
            sampling=t.SamplingParams(top_p=1.5),
            stopping=t.StoppingCriteria(max_tokens=0),
        ),
    )
    _, violations = details(error)
    assert {f for f, _ in violations} == {"n", "sampling.top_p", "stopping.max_tokens"}


async def test_deadline_ends_a_slow_call_and_others_keep_going(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    slow = asyncio.ensure_future(stub.Generate(g.GenerateRequest(model="slow", prompt="x"), timeout=0.5))
    fast = await stub.Generate(g.GenerateRequest(model="echo", prompt="quick"))
    assert fast.generations[0].text == "quick"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await slow
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_stream_cancel_mid_way_leaves_server_serving(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    call = stub.GenerateStream(g.GenerateStreamRequest(request=g.GenerateRequest(model="slow", prompt="x")))
    first = await call.read()
    assert first.WhichOneof("frame") == "start"
    call.cancel()
    ok = await stub.Generate(g.GenerateRequest(model="echo", prompt="after cancel"))
    assert ok.generations[0].text == "after cancel"


async def test_queue_full_is_resource_exhausted_with_retry_info(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    # narrow: one slot and one queue place; the third concurrent call is refused.
    calls = [
        asyncio.ensure_future(stub.Generate(g.GenerateRequest(model="narrow", prompt="x"))) for _ in range(3)
    ]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    errors = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(errors[0])  # type: ignore[arg-type]
    assert status is not None
    assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)


async def test_batch_reports_per_item(stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    requests = [
        g.GenerateRequest(model="echo", prompt="zero"),
        g.GenerateRequest(model="missing", prompt="one"),
        g.GenerateRequest(model="echo", prompt="two", n=0),
        g.GenerateRequest(model="echo", prompt="three"),
    ]
    items = [item async for item in stub.BatchGenerate(g.BatchGenerateRequest(requests=requests))]
    by_index = {item.index: item for item in items}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0].response.generations[0].text == "zero"
    assert by_index[3].response.generations[0].text == "three"
    assert by_index[1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert by_index[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in by_index[2].error.details if d.Is(bad.DESCRIPTOR))
    assert bad.field_violations[0].field == "requests[2].n"  # paths relative to the RPC's request


async def test_empty_batch_is_invalid(stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.BatchGenerate(g.BatchGenerateRequest()):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_stream_field_paths_are_relative_to_the_stream_request(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    bad = [
        g.GenerateRequest(model="echo", prompt="x", n=17),  # refused by the request checks
        g.GenerateRequest(
            model="echo", prompt="x", stopping=t.StoppingCriteria(max_tokens=0)
        ),  # by conversion
    ]
    fields = []
    for request in bad:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.GenerateStream(g.GenerateStreamRequest(request=request)):
                pass
        fields += [field for field, _ in details(caught.value)[1]]
    assert fields == ["request.n", "request.stopping.max_tokens"]


async def test_stream_frames_in_order_with_usage_in_end(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    request = g.GenerateRequest(model="echo", prompt="one two three", n=2)
    frames = [f async for f in stub.GenerateStream(g.GenerateStreamRequest(request=request))]
    kinds = [f.WhichOneof("frame") for f in frames]
    assert kinds[0] == "start" and kinds.count("start") == 1
    ends = [f.end for f in frames if f.WhichOneof("frame") == "end"]
    assert sorted(e.index for e in ends) == [0, 1]
    for end in ends:
        assert end.usage.output_tokens == 3 and end.usage.input_tokens == 3
        assert end.finish_reason == t.FINISH_REASON_STOP
        assert end.timings.HasField("total")
    text0 = "".join(f.delta.text for f in frames if f.WhichOneof("frame") == "delta" and f.delta.index == 0)
    assert text0 == "one two three"


async def test_health_and_reflection(scripted_server: object) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = scripted_server.address  # type: ignore[attr-defined]
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "gengate.v1.GenerationService", "gengate.v1.GenerationService/echo"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = [s.name async for r in replies for s in r.list_services_response.service]
        assert "gengate.v1.GenerationService" in names


async def test_bad_input_never_disturbs_calls_in_flight(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    slow = stub.GenerateStream(g.GenerateStreamRequest(request=g.GenerateRequest(model="slow", prompt="x")))
    first = await slow.read()
    assert first.WhichOneof("frame") == "start"
    bad = [
        g.GenerateRequest(model="echo"),
        g.GenerateRequest(model="nope", prompt="x"),
        g.GenerateRequest(model="echo", prompt="x", n=999),
        g.GenerateRequest(model="echo", prompt="x", structured_output=t.StructuredOutput()),
    ]
    outcomes = await asyncio.gather(*(stub.Generate(r) for r in bad), return_exceptions=True)
    assert all(isinstance(o, grpc.aio.AioRpcError) for o in outcomes)
    frames = []
    while (frame := await slow.read()) != grpc.aio.EOF:
        frames.append(frame)
    text = "".join(f.delta.text for f in frames if f.WhichOneof("frame") == "delta")
    assert text == "a b c d e f g h"
    assert frames[-1].end.finish_reason == t.FINISH_REASON_STOP


async def test_a_batch_larger_than_the_queue_waits_instead_of_failing(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    # narrow: max_concurrency 1, max_queue 1. Six items of one batch are one caller's demand.
    requests = [g.GenerateRequest(model="narrow", prompt=str(i)) for i in range(6)]
    items = [item async for item in stub.BatchGenerate(g.BatchGenerateRequest(requests=requests))]
    assert sorted(i.index for i in items) == list(range(6))
    assert all(i.WhichOneof("result") == "response" for i in items), [i.error.message for i in items]


async def test_a_batch_holds_one_callers_share_of_a_model_and_leaves_its_queue_to_others(
    make_server: ServerFactory,
) -> None:
    """A batch arriving at a model whose queue is full waits instead of failing (one caller's
    demand, bounded by the batch itself), and keeps at most max_concurrency items of the model
    in flight with none queued behind them, so callers arriving meanwhile still get queue room."""
    slow = {"name": "narrow", "backend": "scripted", "text": "a b c d e f", "tokens_per_s": 60,
            "max_concurrency": 1, "max_queue": 1}  # fmt: skip
    server = await make_server({"models": [slow]})
    route = server.router.route("narrow")
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        def call(prompt: str) -> asyncio.Future[g.GenerateResponse]:
            return asyncio.ensure_future(stub.Generate(g.GenerateRequest(model="narrow", prompt=prompt)))

        running = call("one")
        await until(lambda: route.in_flight == 1, "a caller runs")
        queued = call("two")
        await until(lambda: route.waiting == 1, "another waits: the queue is full")
        requests = [g.GenerateRequest(model="narrow", prompt=str(i)) for i in range(4)]
        batch = stub.BatchGenerate(g.BatchGenerateRequest(requests=requests))
        first = await anext(aiter(batch))
        assert first.WhichOneof("result") == "response", first.error.message  # waited, not QUEUE_FULL
        await asyncio.gather(running, queued)
        await until(lambda: route.in_flight == 1, "the next batch item runs")
        assert route.waiting == 0  # its other items wait in the batch, not in the model's queue
        rest = [item async for item in batch]
    items = [first, *rest]
    assert sorted(i.index for i in items) == [0, 1, 2, 3]
    assert all(i.WhichOneof("result") == "response" for i in items), [i.error.message for i in items]
