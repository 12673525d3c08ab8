"""The gRPC layer's own promises, written against mutants of api/servicer.py that survived
(tests/mutation/SURVIVORS.md): the server's default deadline reaches every call kind, a backend's
unexpected exception is INTERNAL UNEXPECTED (its type named, nothing else) and the server goes on,
and batch items' field paths name the item, for small and large batches alike."""

from __future__ import annotations

import logging

import grpc
import pytest
from gengate.logs import RequestContext
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from observe import ServerFactory, field_violations, reason, status_of

SLOW = {"name": "slow", "backend": "scripted", "text": " ".join(["word"] * 400), "tokens_per_s": 20}
PROBE = {"name": "probe", "backend": "scripted", "answer_cancellations_of": "slow"}
BUGGY = {
    "name": "buggy",
    "backend": "scripted",
    "text": "a b c",
    "fail_after_tokens": 1,
    "fail_with": "unexpected",
}


def request(model: str, **fields: object) -> g.GenerateRequest:
    msg = g.GenerateRequest(model=model, prompt="hi", **fields)  # type: ignore[arg-type]
    msg.stopping.max_tokens = 400
    return msg


async def cancellations(stub: generation_pb2_grpc.GenerationServiceStub) -> int:
    reply = await stub.Generate(request("probe"), timeout=10)
    return int(reply.generations[0].text)


async def test_the_server_default_deadline_bounds_calls_without_one(make_server: ServerFactory) -> None:
    """No client deadline: server.request_timeout_s is the call's deadline, in every call kind, and
    the generation is aborted at the server when it passes."""
    server = await make_server({"server": {"request_timeout_s": 0.3}, "models": [SLOW, PROBE]})
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Generate(request("slow"))
        assert unary.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        frames = []
        with pytest.raises(grpc.aio.AioRpcError) as stream:
            async for frame in stub.GenerateStream(g.GenerateStreamRequest(request=request("slow"))):
                frames.append(frame)
        assert stream.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and frames  # it had started
        batch = g.BatchGenerateRequest(requests=[request("slow"), request("probe")])
        items = {item.index: item async for item in stub.BatchGenerate(batch)}
        assert items[0].WhichOneof("result") == "error"
        assert items[0].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert items[1].WhichOneof("result") == "response"
        assert await cancellations(stub) == 3  # all three were aborted at the server


async def test_an_unexpected_backend_exception_is_internal_unexpected_and_the_server_goes_on(
    make_server: ServerFactory,
) -> None:
    server = await make_server({"models": [BUGGY, {"name": "echo", "backend": "scripted"}]})
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Generate(request("buggy"), timeout=10)
        assert unary.value.code() == grpc.StatusCode.INTERNAL and reason(unary.value) == "UNEXPECTED"
        assert unary.value.details() == "unexpected server error: ScriptedBug"
        frames = []
        with pytest.raises(grpc.aio.AioRpcError) as stream:
            async for frame in stub.GenerateStream(
                g.GenerateStreamRequest(request=request("buggy")), timeout=10
            ):
                frames.append(frame)
        assert stream.value.code() == grpc.StatusCode.INTERNAL and reason(stream.value) == "UNEXPECTED"
        assert stream.value.details() == "unexpected server error: ScriptedBug"
        batch = g.BatchGenerateRequest(requests=[request("buggy"), request("echo")])
        items = {item.index: item async for item in stub.BatchGenerate(batch, timeout=10)}
        assert items[0].error.code == grpc.StatusCode.INTERNAL.value[0]
        assert reason(items[0].error) == "UNEXPECTED" and "ScriptedBug" in items[0].error.message
        assert items[1].WhichOneof("result") == "response"
        reply = await stub.Generate(request("echo"), timeout=10)
        assert reply.generations[0].text == "hi"


async def test_an_unexpected_error_is_logged_naming_its_request_and_leaves_no_context_behind(
    make_server: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The traceback of a backend's bug names the request it came from (id and model) in each call
    kind, though the servicer logs it after the call's log context has closed; and no line logged
    after the call is tagged with that request."""
    server = await make_server({"models": [BUGGY, {"name": "echo", "backend": "scripted"}]})
    caplog.handler.addFilter(RequestContext())
    caplog.set_level(logging.INFO)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Generate(request("buggy", request_id="req-unary"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in stub.GenerateStream(
                g.GenerateStreamRequest(request=request("buggy", request_id="req-stream")), timeout=10
            ):
                pass
        batch = g.BatchGenerateRequest(requests=[request("buggy", request_id="req-item")])
        [item] = [item async for item in stub.BatchGenerate(batch, timeout=10)]
        assert item.WhichOneof("result") == "error"
    logging.getLogger("gengate.test").info("after the calls")
    failures = [r for r in caplog.records if r.exc_info and "ScriptedBug" in repr(r.exc_info[1])]
    named = {(r.getMessage(), getattr(r, "request_id", None), getattr(r, "model", None)) for r in failures}
    assert named == {
        ("unexpected error", "req-unary", "buggy"),
        ("unexpected error", "req-stream", "buggy"),
        ("batch item 0 failed", "req-item", "buggy"),
    }
    after = next(r for r in caplog.records if r.getMessage() == "after the calls")
    assert getattr(after, "request_id", "unset") is None and getattr(after, "model", "unset") is None


@pytest.mark.parametrize("padding", [0, 70_000], ids=["small batch", "large batch (converted off the loop)"])
async def test_batch_item_field_paths_name_the_item(make_server: ServerFactory, padding: int) -> None:
    server = await make_server({"models": [{"name": "echo", "backend": "scripted"}]})
    good = request("echo")
    good.prompt = "x" * padding or "hi"
    bad_role = request("echo")
    bad_role.ClearField("prompt")
    bad_role.messages.messages.add(role=t.Role.ValueType(99)).content.add(text="x")
    bad_range = request("echo")
    bad_range.sampling.temperature = -1
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        batch = g.BatchGenerateRequest(requests=[good, bad_role, bad_range])
        items = {item.index: item async for item in stub.BatchGenerate(batch, timeout=30)}
    assert items[0].WhichOneof("result") == "response"
    assert field_violations(items[1].error) == ["requests[1].messages.messages[0].role"]
    assert items[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert field_violations(items[2].error) == ["requests[2].sampling.temperature"]
    assert status_of(items[2].error).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


async def test_a_stream_request_names_its_fields_under_request(make_server: ServerFactory) -> None:
    server = await make_server({"models": [{"name": "echo", "backend": "scripted"}]})
    bad_role = request("echo")
    bad_role.ClearField("prompt")
    bad_role.messages.messages.add(role=t.Role.ValueType(99)).content.add(text="x")
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.GenerateStream(g.GenerateStreamRequest(request=bad_role), timeout=10):
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(caught.value) == ["request.messages.messages[0].role"]


async def test_malformed_bytes_in_an_upload_are_invalid_argument_and_the_server_goes_on(
    make_server: ServerFactory,
) -> None:
    """A client-streaming call (UploadBatchJob) gets the same guard as the unary and server-streaming
    ones: a message that is not protobuf ends the call with INVALID_ARGUMENT MALFORMED_REQUEST, at
    the first message or after a good header, never grpc's bare UNKNOWN."""
    from gengate_proto.v1 import jobs_pb2

    server = await make_server({"models": [{"name": "echo", "backend": "scripted"}]})
    header = jobs_pb2.UploadBatchJobRequest(header=jobs_pb2.BatchJobHeader()).SerializeToString()
    async with grpc.aio.insecure_channel(server.address) as channel:
        upload = channel.stream_unary("/gengate.v1.BatchJobService/UploadBatchJob")
        for messages in ([b"\xff\xff\xff\xff\xff"], [header, b"\x0a\x05\xff\xff"]):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await upload(iter(messages), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, messages
            assert reason(caught.value) == "MALFORMED_REQUEST"
            assert "not a valid protobuf message" in (caught.value.details() or "")
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        assert (await stub.Generate(request("echo"), timeout=10)).generations[0].text == "hi"
        item = jobs_pb2.UploadBatchJobRequest(request=request("echo")).SerializeToString()
        reply = jobs_pb2.UploadBatchJobResponse.FromString(
            await upload(iter([header, item, item]), timeout=10)
        )
        assert reply.job.id and reply.job.total == 2  # a good upload after the bad ones


async def test_a_stream_names_its_request_and_model_and_passes_a_valid_structured_result(
    make_server: ServerFactory,
) -> None:
    """The start frame carries the caller's request id and the served name, and a structured
    result that is valid ends the stream OK: validation reads each generation's own text."""
    digits = {
        "name": "digits",
        "backend": "scripted",
        "text": "123 456",
        "constraints": {"regex": "validated"},
    }
    server = await make_server({"models": [digits]})
    streamed = request("digits", request_id="caller-7", n=2)
    streamed.structured_output.regex.pattern = "[0-9]+( [0-9]+)*"
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        frames = [f async for f in stub.GenerateStream(g.GenerateStreamRequest(request=streamed), timeout=10)]
        unary = await stub.Generate(streamed, timeout=10)
    start = frames[0].start
    assert (start.request_id, start.model) == ("caller-7", "digits")
    ends = [f.end for f in frames if f.WhichOneof("frame") == "end"]
    assert sorted(e.index for e in ends) == [0, 1]
    assert (unary.request_id, unary.model, [x.text for x in unary.generations]) == (
        "caller-7", "digits", ["123 456", "123 456"],
    )  # fmt: skip


async def test_a_batch_of_exactly_max_batch_items_is_served(make_server: ServerFactory) -> None:
    server = await make_server(
        {"server": {"max_batch_items": 2}, "models": [{"name": "echo", "backend": "scripted"}]}
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        two = g.BatchGenerateRequest(requests=[request("echo"), request("echo")])
        assert len([item async for item in stub.BatchGenerate(two, timeout=10)]) == 2
        three = g.BatchGenerateRequest(requests=[request("echo")] * 3)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.BatchGenerate(three, timeout=10):
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(caught.value) == ["requests"]


def _error_metadata(error: grpc.aio.AioRpcError) -> dict[str, str]:
    from google.rpc import error_details_pb2

    for detail in status_of(error).details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return dict(info.metadata)
    return {}


@pytest.mark.parametrize(
    ("claimed", "code", "why"),
    [
        ("native", grpc.StatusCode.INTERNAL, "CONSTRAINT_VIOLATED"),
        ("validated", grpc.StatusCode.ABORTED, "VALIDATION_FAILED"),
    ],
)
async def test_an_invalid_result_says_how_it_was_enforced(
    make_server: ServerFactory, claimed: str, code: grpc.StatusCode, why: str
) -> None:
    liar = {"name": "liar", "backend": "scripted", "text": "abc", "constraints": {"regex": claimed}}
    server = await make_server({"models": [liar]})
    asked = request("liar")
    asked.structured_output.regex.pattern = "[0-9]+"
    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generation_pb2_grpc.GenerationServiceStub(channel).Generate(asked, timeout=10)
    assert caught.value.code() == code and reason(caught.value) == why
    assert _error_metadata(caught.value) == {"enforcement": claimed}
    assert "regex" in (caught.value.details() or "")


async def test_unary_timings_count_from_the_call_s_arrival(make_server: ServerFactory) -> None:
    """total covers the whole call (here at least the model's configured first-token latency)."""
    delayed = {"name": "delayed", "backend": "scripted", "text": "a b", "latency_s": 0.05}
    server = await make_server({"models": [delayed]})
    async with grpc.aio.insecure_channel(server.address) as channel:
        reply = await generation_pb2_grpc.GenerationServiceStub(channel).Generate(
            request("delayed"), timeout=10
        )
    total = reply.timings.total.ToNanoseconds() / 1e9
    assert reply.timings.HasField("total") and 0.05 <= total < 60
