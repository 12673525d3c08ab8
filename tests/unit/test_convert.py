"""Round trips between protobuf and domain objects, and presence of optional fields."""

from __future__ import annotations

import pytest
from gengate import domain as d
from gengate.api import convert
from gengate.errors import InvalidArgument
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import types_pb2 as t

REQUESTS = [
    d.GenerationRequest(model="m", prompt="hi"),
    d.GenerationRequest(
        model="m",
        messages=(
            d.ChatMessage(d.Role.SYSTEM, (d.TextPart("be brief"),)),
            d.ChatMessage(
                d.Role.USER,
                (
                    d.TextPart("look"),
                    d.ImagePart(data=b"\x89PNG", mime_type="image/png"),
                    d.ImagePart(url="u"),
                ),
                name="ann",
            ),
        ),
        sampling=d.SamplingParams(temperature=0.0, top_p=0.5, top_k=40, seed=2**62),
        stopping=d.StoppingCriteria(max_tokens=7, stop=("\n", "END")),
        n=3,
        logprobs=0,
        structured_output=d.StructuredOutput(
            d.JsonSchemaConstraint(
                {"type": "object", "properties": {"age": {"type": "integer", "maximum": 150}}},
                name="p",
                strict=True,
            ),
            whitespace=d.Whitespace.COMPACT,
            additional_properties=False,
        ),
        backend_options={"a": 1, "b": 1.5, "c": True, "d": "x"},
        request_id="r1",
    ),
    d.GenerationRequest(
        model="m", prompt="", structured_output=d.StructuredOutput(d.RegexConstraint(r"\d+"))
    ),
    d.GenerationRequest(
        model="m", prompt="p", structured_output=d.StructuredOutput(d.ChoiceConstraint(("a", "b")))
    ),
    d.GenerationRequest(
        model="m",
        prompt="p",
        structured_output=d.StructuredOutput(d.GrammarConstraint(d.GrammarSyntax.GBNF, "x")),
    ),
    d.GenerationRequest(
        model="m", prompt="p", structured_output=d.StructuredOutput(d.JsonObjectConstraint())
    ),
]


@pytest.mark.parametrize("request_", REQUESTS)
def test_request_round_trip(request_: d.GenerationRequest) -> None:
    wire = convert.request_to_pb(request_).SerializeToString()
    back = convert.request_from_pb(g.GenerateRequest.FromString(wire))
    assert back == request_


def test_unset_optionals_stay_unset() -> None:
    back = convert.request_from_pb(g.GenerateRequest(model="m", prompt="x"))
    assert back.sampling == d.SamplingParams()
    assert back.stopping.max_tokens is None and back.logprobs is None and back.n == 1


def test_zero_temperature_is_not_unset() -> None:
    msg = g.GenerateRequest(model="m", prompt="x", sampling=t.SamplingParams(temperature=0.0))
    assert convert.request_from_pb(msg).sampling.temperature == 0.0


def test_schema_integers_survive_struct() -> None:
    msg = convert.request_to_pb(REQUESTS[1])
    schema = convert.request_from_pb(msg).structured_output.constraint.schema  # type: ignore[union-attr]
    assert schema["properties"]["age"]["maximum"] == 150
    assert isinstance(schema["properties"]["age"]["maximum"], int)


def test_result_round_trip() -> None:
    result = d.GenerationResult(
        request_id="r",
        model="m",
        generations=(
            d.Generation(
                0,
                "ab",
                d.FinishReason.STOP_SEQUENCE,
                2,
                matched_stop="\n",
                logprobs=(d.TokenLogprob("a", -0.5, 7, (d.TopLogprob("b", -1.0, 8),)),),
            ),
            d.Generation(1, "", d.FinishReason.LENGTH, 0),
        ),
        usage=d.Usage(3, 2, cached_input_tokens=1),
        enforcement=d.Enforcement.ENGINE,
        effective_sampling=d.SamplingParams(seed=5),
        effective_stopping=d.StoppingCriteria(max_tokens=9),
        timings=d.Timings(0.001, 0.25, 1.5),
    )
    back = convert.result_from_pb(
        g.GenerateResponse.FromString(convert.result_to_pb(result).SerializeToString())
    )
    assert back == result


def test_bad_enum_names_field_inside_batch() -> None:
    msg = g.GenerateRequest(
        model="m",
        prompt="p",
        structured_output=t.StructuredOutput(grammar=t.Grammar(definition="x")),
    )
    with pytest.raises(InvalidArgument) as caught:
        convert.request_from_pb(msg, prefix="requests[2].")
    assert caught.value.violations[0].field == "requests[2].structured_output.grammar.syntax"


def test_stream_events_convert() -> None:
    start = convert.event_to_pb(d.StreamStart("r", "m", 4, d.Enforcement.VALIDATED))
    assert start.start.input_tokens == 4 and start.start.enforcement == t.ENFORCEMENT_VALIDATED
    end = convert.event_to_pb(d.GenerationEnd(1, d.FinishReason.STOP, d.Usage(4, 2)))
    assert end.end.usage.output_tokens == 2 and not end.end.HasField("matched_stop")


def test_schema_json_keeps_property_order_and_big_integers() -> None:
    text = (
        '{"type": "object", "properties": '
        '{"zeta": {"type": "integer", "maximum": 9007199254740993}, "alpha": {}}}'
    )
    msg = g.GenerateRequest(
        model="m",
        prompt="p",
        structured_output=t.StructuredOutput(json_schema=t.JsonSchema(schema_json=text)),
    )
    schema = convert.request_from_pb(msg).structured_output.constraint.schema  # type: ignore[union-attr]
    assert list(schema["properties"]) == ["zeta", "alpha"]
    assert schema["properties"]["zeta"]["maximum"] == 9007199254740993


@pytest.mark.parametrize(
    ("json_schema", "field"),
    [
        (t.JsonSchema(), "structured_output.json_schema.schema"),
        (t.JsonSchema(schema_json="{not json"), "structured_output.json_schema.schema_json"),
        (t.JsonSchema(schema_json="[1]"), "structured_output.json_schema.schema_json"),
    ],
)
def test_bad_schema_sources_name_the_field(json_schema: t.JsonSchema, field: str) -> None:
    msg = g.GenerateRequest(
        model="m", prompt="p", structured_output=t.StructuredOutput(json_schema=json_schema)
    )
    with pytest.raises(InvalidArgument) as caught:
        convert.request_from_pb(msg)
    assert caught.value.violations[0].field == field


def test_schema_and_schema_json_together_are_refused() -> None:
    both = t.JsonSchema(schema_json="{}")
    both.schema.update({"type": "object"})
    msg = g.GenerateRequest(model="m", prompt="p", structured_output=t.StructuredOutput(json_schema=both))
    with pytest.raises(InvalidArgument, match="not both"):
        convert.request_from_pb(msg)
