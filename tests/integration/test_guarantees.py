"""The guarantee "every structured result is validated before it is returned", held at the gRPC
level by models that misbehave on purpose: a `scripted` model claiming a constraint kind answers
text that violates it. Claimed ENGINE/NATIVE enforcement that fails is INTERNAL
CONSTRAINT_VIOLATED (a server fault, never a success); VALIDATED is ABORTED VALIDATION_FAILED.
Streams end with that status after their frames, never OK; a batch fails only that item. A
constraint a model cannot enforce is refused (UNIMPLEMENTED), never answered as free text."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from gengate.api.server import RunningServer
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from observe import ServerFactory, field_violations, reason, until

WRONG = "definitely not valid"
REGEX = t.StructuredOutput(regex=t.Regex(pattern="[0-9]{3}"))


@pytest.fixture
async def stub(make_server: ServerFactory) -> AsyncIterator[generation_pb2_grpc.GenerationServiceStub]:
    def liar(name: str, level: str) -> dict[str, object]:
        return {"name": name, "backend": "scripted", "text": WRONG, "constraints": {"regex": level}}

    server: RunningServer = await make_server(
        {
            "models": [
                liar("engine-liar", "engine"),
                liar("native-liar", "native"),
                liar("validated-liar", "validated"),
                {"name": "honest", "backend": "scripted", "text": "123", "constraints": {"regex": "engine"}},
                {"name": "plain", "backend": "scripted", "text": "free text"},  # enforces nothing
            ]
        }
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def request(model: str) -> g.GenerateRequest:
    return g.GenerateRequest(model=model, prompt="x", structured_output=REGEX)


EXPECTED = {
    "engine-liar": (grpc.StatusCode.INTERNAL, "CONSTRAINT_VIOLATED"),
    "native-liar": (grpc.StatusCode.INTERNAL, "CONSTRAINT_VIOLATED"),
    "validated-liar": (grpc.StatusCode.ABORTED, "VALIDATION_FAILED"),
}


@pytest.mark.parametrize("model", sorted(EXPECTED))
async def test_an_invalid_result_is_never_a_unary_success(
    stub: generation_pb2_grpc.GenerationServiceStub, model: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(request(model))
    assert (caught.value.code(), reason(caught.value)) == EXPECTED[model]
    assert WRONG[:10] in (caught.value.details() or "")  # says which text failed
    ok = await stub.Generate(request("honest"))
    assert ok.generations[0].text == "123"


@pytest.mark.parametrize("model", sorted(EXPECTED))
async def test_a_stream_with_an_invalid_result_ends_with_the_error_not_ok(
    stub: generation_pb2_grpc.GenerationServiceStub, model: str
) -> None:
    frames = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for frame in stub.GenerateStream(g.GenerateStreamRequest(request=request(model))):
            frames.append(frame)
    assert (caught.value.code(), reason(caught.value)) == EXPECTED[model]
    assert frames and frames[0].HasField("start")
    assert not any(f.HasField("end") for f in frames)  # no end frame for the invalid generation


async def test_a_batch_fails_only_the_item_whose_result_is_invalid(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    items = [request("honest"), request("engine-liar"), request("validated-liar"), request("honest")]
    answers = {a.index: a async for a in stub.BatchGenerate(g.BatchGenerateRequest(requests=items))}
    assert answers[0].response.generations[0].text == "123"
    assert answers[3].response.generations[0].text == "123"
    assert answers[1].error.code == grpc.StatusCode.INTERNAL.value[0]
    assert answers[2].error.code == grpc.StatusCode.ABORTED.value[0]


EVERY_KIND = {
    "json_schema": t.StructuredOutput(json_schema=t.JsonSchema(schema_json='{"type": "object"}')),
    "json_object": t.StructuredOutput(json_object=t.JsonObject()),
    "regex": REGEX,
    "choice": t.StructuredOutput(choice=t.Choice(choices=["a", "b"])),
    "grammar": t.StructuredOutput(grammar=t.Grammar(syntax=t.GRAMMAR_SYNTAX_LARK, definition='start: "a"')),
}


@pytest.mark.parametrize("kind", sorted(EVERY_KIND))
async def test_a_constraint_the_model_cannot_enforce_is_refused_never_dropped(
    stub: generation_pb2_grpc.GenerationServiceStub, kind: str
) -> None:
    """Unary, stream and batch item alike: UNIMPLEMENTED naming the field, never the free text."""
    asked = g.GenerateRequest(model="plain", prompt="x", structured_output=EVERY_KIND[kind])
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await stub.Generate(asked)
    assert unary.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert reason(unary.value) == "CONSTRAINT_UNSUPPORTED"
    assert field_violations(unary.value) == [f"structured_output.{kind}"]
    frames = []
    with pytest.raises(grpc.aio.AioRpcError) as streamed:
        async for frame in stub.GenerateStream(g.GenerateStreamRequest(request=asked)):
            frames.append(frame)
    assert streamed.value.code() == grpc.StatusCode.UNIMPLEMENTED and frames == []
    assert field_violations(streamed.value) == [f"request.structured_output.{kind}"]
    free = g.GenerateRequest(model="plain", prompt="x")
    answers = [a async for a in stub.BatchGenerate(g.BatchGenerateRequest(requests=[free, asked]))]
    by_index = {a.index: a for a in answers}
    assert by_index[0].response.generations[0].text == "free text"
    assert by_index[1].error.code == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert not by_index[1].HasField("response")


async def test_a_stream_that_fails_mid_generation_ends_with_its_error_not_ok(
    make_server: ServerFactory,
) -> None:
    """Errors are never hidden inside a successful-looking stream: frames, then the status."""
    server = await make_server(
        {"models": [{"name": "flaky", "backend": "scripted", "text": "a b c d e f", "fail_after_tokens": 3}]}
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        frames = []
        stream = stub.GenerateStream(
            g.GenerateStreamRequest(request=g.GenerateRequest(model="flaky", prompt="x"))
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for frame in stream:
                frames.append(frame)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert reason(caught.value) == "SCRIPTED_FAULT"
        deltas = "".join(f.delta.text for f in frames if f.HasField("delta"))
        assert deltas == "a b c" and not any(f.HasField("end") for f in frames)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Generate(g.GenerateRequest(model="flaky", prompt="x"))
        assert unary.value.code() == grpc.StatusCode.UNAVAILABLE
        batch = [
            a
            async for a in stub.BatchGenerate(
                g.BatchGenerateRequest(requests=[g.GenerateRequest(model="flaky", prompt="x")])
            )
        ]
        assert batch[0].error.code == grpc.StatusCode.UNAVAILABLE.value[0]


async def test_cancel_and_deadline_abort_the_generation_at_the_server(make_server: ServerFactory) -> None:
    """Not only the client's teardown: the backend's generation is abandoned and its slot freed."""
    server = await make_server(
        {"models": [{"name": "slow", "backend": "scripted", "text": "w " * 400, "tokens_per_s": 20}]}
    )
    route = server.router.routes[0]
    backend = route.backend
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        call = stub.GenerateStream(
            g.GenerateStreamRequest(request=g.GenerateRequest(model="slow", prompt="x"))
        )
        async for frame in call:
            if frame.HasField("delta"):
                break
        call.cancel()
        await until(lambda: getattr(backend, "cancelled", 0) == 1 and route.in_flight == 0, "stream aborted")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(g.GenerateRequest(model="slow", prompt="x"), timeout=0.3)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: getattr(backend, "cancelled", 0) == 2 and route.in_flight == 0, "unary aborted")
        batch = stub.BatchGenerate(
            g.BatchGenerateRequest(requests=[g.GenerateRequest(model="slow", prompt="x")] * 3)
        )
        await until(lambda: route.in_flight == 3, "the batch items are generating")
        batch.cancel()
        await until(
            lambda: getattr(backend, "cancelled", 0) == 5 and route.in_flight == 0, "batch items aborted"
        )


async def test_what_the_engine_enforced_the_validator_accepts_for_rust_only_regex_syntax(
    make_server: ServerFactory,
) -> None:
    """A class intersection means consonants to the grammar engine (Rust regex syntax) and literal
    characters to RE2: validating with RE2 turned every correct output into INTERNAL
    CONSTRAINT_VIOLATED (found by mutation testing). Now validation agrees with enforcement."""
    pytest.importorskip("llama_cpp")
    server = await make_server({"models": [{"name": "tiny", "backend": "llamacpp", "tiny": True}]})
    request = g.GenerateRequest(
        model="tiny",
        prompt="Letters:",
        n=4,
        structured_output=t.StructuredOutput(regex=t.Regex(pattern="[a-z&&[^aeiou]]{3,8}")),
    )
    request.stopping.max_tokens = 16
    request.sampling.seed = 7
    async with grpc.aio.insecure_channel(server.address) as channel:
        reply = await generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=60)
    assert len(reply.generations) == 4
    for generation in reply.generations:
        assert 3 <= len(generation.text) <= 8 and set(generation.text) <= set("bcdfghjklmnpqrstvwxyz")
