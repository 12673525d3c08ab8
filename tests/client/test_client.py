"""The blocking and asyncio clients against the fake server: requests built, results typed, errors decoded."""

from __future__ import annotations

import enum
import json
from typing import Literal

import grpc
import pytest
from fake_gengate import RunningFake, default_responder
from gengate_client import (
    AsyncClient,
    Client,
    Enforcement,
    FinishReason,
    GengateError,
    ImagePart,
    InvalidArgumentError,
    Message,
    NotFoundError,
    Regex,
    Request,
    StreamAccumulator,
    StreamDelta,
    StreamEnd,
    StreamStart,
    TruncatedOutputError,
    UnavailableError,
)
from gengate_proto.v1 import generation_pb2, types_pb2
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str
    population: int = Field(ge=0)
    country_code: str = Field(pattern=r"^[A-Z]{2}$")


class Mood(enum.Enum):
    HAPPY = "happy"
    SAD = "sad"


def test_generate_sends_every_field_and_returns_typed_response(fake: RunningFake) -> None:
    with Client(fake.address) as client:
        resp = client.generate(
            "tiny",
            "Hello",
            max_tokens=7,
            temperature=0.0,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
            presence_penalty=0.3,
            seed=42,
            stop=["\n", "END"],
            n=2,
            logprobs=3,
            backend_options={"cache": True, "threads": 2, "scale": 0.5, "mode": "fast"},
            request_id="abc",
        )
    sent = fake.servicer.requests[-1]
    assert sent.prompt == "Hello" and sent.model == "tiny" and sent.request_id == "abc"
    assert sent.stopping.max_tokens == 7 and list(sent.stopping.stop) == ["\n", "END"]
    assert sent.sampling.HasField("temperature") and sent.sampling.temperature == 0.0
    assert sent.sampling.top_k == 40 and sent.sampling.seed == 42
    assert sent.sampling.min_p == pytest.approx(0.05)
    assert sent.n == 2 and sent.logprobs == 3
    assert sent.backend_options["cache"].bool_value is True
    assert sent.backend_options["threads"].int_value == 2
    assert sent.backend_options["scale"].double_value == 0.5
    assert sent.backend_options["mode"].string_value == "fast"
    assert not sent.HasField("structured_output")
    assert resp.texts == ["echo 0: Hello", "echo 1: Hello"] and resp.text == "echo 0: Hello"
    assert resp.generations[1].index == 1 and resp.finish_reason is FinishReason.STOP
    assert resp.usage.input_tokens == 5 and resp.usage.output_tokens == 6
    assert resp.enforcement is Enforcement.NONE and resp.seed == 42 and resp.request_id == "abc"
    assert resp.timings.total == pytest.approx(0.012) and resp.timings.queue is None
    assert resp.parsed is None
    assert isinstance(resp.raw, generation_pb2.GenerateResponse)


def test_unset_fields_stay_unset(fake: RunningFake) -> None:
    with Client(fake.address) as client:
        resp = client.generate("tiny", "x")
    sent = fake.servicer.requests[-1]
    assert not sent.sampling.HasField("temperature") and not sent.HasField("n")
    assert not sent.stopping.HasField("max_tokens") and not sent.HasField("logprobs")
    assert resp.seed == 1234  # drawn by the server, echoed back


def test_messages_from_dicts_and_typed_objects(fake: RunningFake) -> None:
    with Client(fake.address) as client:
        client.generate(
            "tiny",
            messages=[
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image", "data": b"\x89PNG", "mime_type": "image/png"},
                        {"type": "image", "url": "https://example.com/cat.png"},
                    ],
                },
                Message("assistant", [ImagePart(url="https://example.com/a.jpg")], name="bot"),
            ],
        )
        with pytest.raises(ValueError, match="role"):
            client.generate("tiny", messages=[{"role": "robot", "content": "x"}])
        with pytest.raises(ValueError, match="not both"):
            client.generate("tiny", "p", messages=[{"role": "user", "content": "x"}])
    msgs = fake.servicer.requests[-1].messages.messages
    assert [m.role for m in msgs] == [types_pb2.ROLE_SYSTEM, types_pb2.ROLE_USER, types_pb2.ROLE_ASSISTANT]
    assert msgs[0].content[0].text == "Be brief."
    assert msgs[1].content[1].image.data == b"\x89PNG" and msgs[1].content[1].image.mime_type == "image/png"
    assert msgs[1].content[2].image.url == "https://example.com/cat.png"
    assert msgs[2].name == "bot" and msgs[2].content[0].image.url == "https://example.com/a.jpg"


def test_structured_outputs_are_parsed(fake: RunningFake) -> None:
    with Client(fake.address) as client:
        city = client.generate_object("tiny", "A city", output_type=City)
        assert city == City(name="Paris", population=2161000, country_code="FR")
        resp = client.generate("tiny", "Mood?", output_type=Mood, n=2)
        assert resp.parsed_all == [Mood.HAPPY, Mood.SAD] and resp.enforcement is Enforcement.ENGINE
        assert client.generate("tiny", "?", output_type=Literal["sad", "happy"]).parsed == "sad"
        assert client.generate("tiny", "date", output_type=Regex(r"\d{4}-\d{2}-\d{2}")).parsed == "2024-01-31"
    sent = fake.servicer.requests[0]
    sent_schema = sent.structured_output.json_schema
    assert not sent_schema.HasField("schema")  # sent as JSON text: keeps property order
    assert list(json.loads(sent_schema.schema_json)["properties"]) == list(
        City.model_json_schema()["properties"]
    )


def test_truncated_structured_output_raises_with_the_response(fake: RunningFake) -> None:
    def truncated(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
        resp = default_responder(request)
        resp.generations[0].text = '{"name": "Par'
        resp.generations[0].finish_reason = types_pb2.FINISH_REASON_LENGTH
        return resp

    fake.servicer.responder = truncated
    with Client(fake.address) as client, pytest.raises(TruncatedOutputError, match="max_tokens") as info:
        client.generate("tiny", "A city", output_type=City, max_tokens=4)
    assert info.value.text == '{"name": "Par'
    assert info.value.response is not None and info.value.response.finish_reason is FinishReason.LENGTH


def test_rpc_errors_carry_status_details(fake: RunningFake) -> None:
    with Client(fake.address) as client:
        with pytest.raises(NotFoundError) as missing:
            client.generate("nope", "x")
        assert missing.value.code is grpc.StatusCode.NOT_FOUND
        assert missing.value.reason == "MODEL_NOT_FOUND" and missing.value.domain == "gengate.dev"
        assert "nope" in missing.value.message and str(missing.value).startswith("NOT_FOUND: ")
        with pytest.raises(InvalidArgumentError) as bad:
            client.generate("tiny", "x", max_tokens=0)  # no client-side check: the server judges
        assert bad.value.field_violations[0].field == "stopping.max_tokens"
        assert bad.value.reason == "INVALID_FIELD"


def test_retry_after_and_unknown_codes(fake: RunningFake) -> None:
    from fake_gengate import Abort, rich_status
    from google.rpc import code_pb2

    def busy(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
        raise Abort(
            rich_status(code_pb2.RESOURCE_EXHAUSTED, "queue full", reason="QUEUE_FULL", retry_after_s=1.5)
        )

    fake.servicer.responder = busy
    with Client(fake.address) as client, pytest.raises(GengateError) as info:
        client.generate("tiny", "x")
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_after == 1.5
    with Client("127.0.0.1:1", timeout=2) as client, pytest.raises(UnavailableError):
        client.list_models()


def test_client_metadata_and_per_call_metadata(fake: RunningFake) -> None:
    with Client(fake.address, metadata={"authorization": "Bearer t0k", "x-team": "a"}) as client:
        client.generate("tiny", "x", metadata={"x-team": "b"})
    seen = fake.servicer.metadata[-1]
    assert seen["authorization"] == "Bearer t0k" and seen["x-team"] == "b"


def test_stream_frames_and_accumulator(fake: RunningFake) -> None:
    acc = StreamAccumulator()
    with Client(fake.address) as client:
        frames = [acc.add(f) for f in client.generate_stream("tiny", "one two three", n=2, seed=3)]
    assert isinstance(frames[0], StreamStart) and frames[0].seed == 3 and frames[0].input_tokens == 5
    assert all(isinstance(f, StreamDelta) for f in frames[1:5])
    ends = [f for f in frames if isinstance(f, StreamEnd)]
    assert [e.index for e in ends] == [0, 1] and ends[0].finish_reason is FinishReason.STOP
    assert ends[0].timings.total == pytest.approx(0.007) and ends[0].usage.output_tokens == 3
    assert acc.texts == ["echo 0: one two three", "echo 1: one two three"]
    assert acc.finish_reasons == {0: FinishReason.STOP, 1: FinishReason.STOP} and acc.output_tokens == 6


def test_stream_error_midway_is_raised_typed(fake: RunningFake) -> None:
    fake.servicer.stream_error_after = 2
    received: list[str] = []
    with Client(fake.address) as client, pytest.raises(UnavailableError) as info:
        for frame in client.generate_stream("tiny", "a b c d e f"):
            if isinstance(frame, StreamDelta):
                received.append(frame.text)
    assert received == ["echo ", "0: "] and info.value.reason == "WORKER_CRASHED"


def test_stream_error_before_first_frame(fake: RunningFake) -> None:
    with Client(fake.address) as client, pytest.raises(NotFoundError):
        list(client.generate_stream("missing", "x"))


def test_batch_ordered_with_per_item_errors(fake: RunningFake) -> None:
    with Client(fake.address) as client:
        items = client.batch_generate(
            [
                {"model": "tiny", "prompt": "a"},
                Request(model="nope", prompt="b"),
                {"model": "tiny", "prompt": "c", "output_type": City},
                {"model": "tiny", "prompt": "d", "max_tokens": 0},
            ]
        )
        streamed = [item.index for item in client.batch_generate_iter([{"model": "tiny", "prompt": "x"}] * 3)]
    assert [i.index for i in items] == [0, 1, 2, 3]
    assert items[0].ok and items[0].unwrap().text == "echo 0: a"
    assert isinstance(items[1].error, NotFoundError) and items[1].error.reason == "MODEL_NOT_FOUND"
    assert items[2].response is not None and items[2].response.parsed.country_code == "FR"
    assert isinstance(items[3].error, InvalidArgumentError)
    assert items[3].error.field_violations[0].field == "stopping.max_tokens"
    with pytest.raises(InvalidArgumentError):
        items[3].unwrap()
    assert streamed == [2, 1, 0]  # completion order, as the server sent them


def test_list_models(fake: RunningFake) -> None:
    from gengate_client import ConstraintKind, GrammarSyntax, Modality

    with Client(fake.address) as client:
        models = client.list_models()
    tiny = models[0]
    assert tiny.name == "tiny" and tiny.backend == "llamacpp"
    assert tiny.capabilities.enforcement_of(ConstraintKind.REGEX) is Enforcement.ENGINE
    assert tiny.capabilities.enforcement_of(ConstraintKind.JSON_OBJECT) is None
    assert tiny.capabilities.grammar_syntaxes == (GrammarSyntax.LARK, GrammarSyntax.GBNF)
    assert tiny.capabilities.input_modalities == (Modality.TEXT,)
    assert tiny.capabilities.max_n == 8 and tiny.capabilities.context_length == 2048
    assert tiny.capabilities.backend_options == ("ignore_eos", "min_tokens")
    assert models[1].name == "remote" and models[1].capabilities.constraints == ()
    assert models[1].capabilities.backend_options == ()


async def test_async_client_same_surface(fake: RunningFake) -> None:
    async with AsyncClient(fake.address, metadata=[("authorization", "Bearer a")], timeout=10) as client:
        resp = await client.generate("tiny", "hi", seed=5)
        assert resp.text == "echo 0: hi" and resp.seed == 5
        city = await client.generate_object("tiny", "city", output_type=City)
        assert city.population == 2161000
        acc = StreamAccumulator()
        async for frame in client.generate_stream("tiny", "x y"):
            acc.add(frame)
        assert acc.text == "echo 0: x y" and acc.start is not None
        items = await client.batch_generate(
            [{"model": "tiny", "prompt": "a"}, {"model": "zzz", "prompt": "b"}]
        )
        assert items[0].ok and isinstance(items[1].error, NotFoundError)
        assert [m.name for m in await client.list_models()] == ["tiny", "remote"]
        with pytest.raises(InvalidArgumentError) as info:
            await client.generate("tiny", "x", n=1000)
        assert info.value.field_violations[0].field == "n"
        fake.servicer.stream_error_after = 1
        with pytest.raises(UnavailableError):
            async for _ in client.generate_stream("tiny", "a b c"):
                pass
    assert fake.servicer.metadata[0]["authorization"] == "Bearer a"


def test_leaving_a_stream_early_cancels_it(fake: RunningFake) -> None:
    fake.servicer.stream_delay_s = 0.05
    with Client(fake.address) as client:
        stream = client.generate_stream("tiny", " ".join(["w"] * 50))
        next(stream)
        next(stream)
        stream.close()
    assert fake.servicer.stream_cancelled.wait(5)
    assert not fake.servicer.stream_completed.is_set()


def test_trace_context_is_propagated(fake: RunningFake) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("caller") as span, Client(fake.address) as client:
        client.generate("tiny", "x")
        trace_id = format(span.get_span_context().trace_id, "032x")
    assert trace_id in fake.servicer.metadata[-1]["traceparent"]
    assert trace.get_current_span().get_span_context().is_valid is False


def test_batch_progress_counts_done_and_failed(fake: RunningFake, capsys: pytest.CaptureFixture[str]) -> None:
    with Client(fake.address) as client:
        items = client.batch_generate(
            [
                {"model": "tiny", "prompt": "a"},
                {"model": "nope", "prompt": "b"},
                {"model": "tiny", "prompt": "c"},
            ],
            progress=True,
        )
    assert [i.ok for i in items] == [True, False, True]
    err = capsys.readouterr().err
    assert "3/3" in err and "failed=1" in err.replace(" ", "")


def test_batch_progress_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import sys

    from gengate_client._progress import BatchProgress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    out = io.StringIO()
    bar = BatchProgress(2, enabled=True, stream=out)
    bar.update(type("Item", (), {"ok": False})())  # type: ignore[arg-type]
    bar.update(type("Item", (), {"ok": True})())  # type: ignore[arg-type]
    bar.close()
    assert out.getvalue().rstrip().endswith("batch: 2/2 done, 1 failed")
