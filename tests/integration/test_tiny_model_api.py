"""The real server on the embedded default (tiny model on llama.cpp, in its worker process):
every constraint kind holds on every finished generation, bad constraints are refused with the
field named, n and seeds behave, and the server goes on serving throughout."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import jsonschema
import pytest
from gengate.api.server import RunningServer
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from google.rpc import error_details_pb2
from grpc_status import rpc_status

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
async def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    from gengate.api.server import start_server
    from gengate.config import parse_config

    server = await start_server(
        parse_config({"models": [{"name": "tiny", "backend": "llamacpp", "tiny": True}]}),
        host="127.0.0.1",
        port=0,
    )
    yield server
    await server.stop(grace=0.5)


@pytest.fixture
async def stub(tiny_server: RunningServer) -> AsyncIterator[generation_pb2_grpc.GenerationServiceStub]:
    async with grpc.aio.insecure_channel(tiny_server.address) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def request(constraint: t.StructuredOutput | None = None, **kw: Any) -> g.GenerateRequest:
    kw.setdefault("stopping", t.StoppingCriteria(max_tokens=200))
    return g.GenerateRequest(model="tiny", prompt="Answer:", structured_output=constraint, **kw)


def schema(value: dict[str, Any]) -> t.StructuredOutput:
    return t.StructuredOutput(json_schema=t.JsonSchema(schema_json=json.dumps(value)))


LARK = 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,5}/'
GBNF = 'root ::= "yes" | "no" | "maybe"'

CASES: list[tuple[str, t.StructuredOutput, Any]] = [
    ("json_schema", schema(PERSON), lambda s: jsonschema.validate(json.loads(s), PERSON)),
    (
        "regex",
        t.StructuredOutput(regex=t.Regex(pattern=r"\d{3}-[A-Z]{2}")),
        lambda s: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", s),
    ),
    (
        "choice",
        t.StructuredOutput(choice=t.Choice(choices=["red", "green", "blue"])),
        lambda s: s in {"red", "green", "blue"},
    ),
    (
        "lark",
        t.StructuredOutput(grammar=t.Grammar(syntax=t.GRAMMAR_SYNTAX_LARK, definition=LARK)),
        lambda s: re.fullmatch(r"\([a-z]{1,5}(,[a-z]{1,5})*\)", s),
    ),
    (
        "gbnf",
        t.StructuredOutput(grammar=t.Grammar(syntax=t.GRAMMAR_SYNTAX_GBNF, definition=GBNF)),
        lambda s: s in {"yes", "no", "maybe"},
    ),
    (
        "json_object",
        t.StructuredOutput(json_object=t.JsonObject()),
        lambda s: isinstance(json.loads(s), dict),
    ),
]


@pytest.mark.parametrize(("name", "constraint", "check"), CASES, ids=[c[0] for c in CASES])
async def test_every_kind_holds_on_every_finished_generation(
    stub: generation_pb2_grpc.GenerationServiceStub, name: str, constraint: t.StructuredOutput, check: Any
) -> None:
    stopping = t.StoppingCriteria(max_tokens=600)  # random weights: JSON strings can ramble
    reply = await stub.Generate(
        request(constraint, n=4, sampling=t.SamplingParams(seed=11), stopping=stopping)
    )
    assert reply.enforcement == t.ENFORCEMENT_ENGINE
    finished = [gen for gen in reply.generations if gen.finish_reason == t.FINISH_REASON_STOP]
    assert len(reply.generations) == 4 and finished, [gen.finish_reason for gen in reply.generations]
    for gen in finished:
        assert check(gen.text) is not False, (name, gen.text)


async def test_same_seed_same_output_across_calls(stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    first = await stub.Generate(request(n=2, sampling=t.SamplingParams(seed=5, temperature=0.9)))
    again = await stub.Generate(request(n=2, sampling=t.SamplingParams(seed=5, temperature=0.9)))
    assert [x.text for x in first.generations] == [x.text for x in again.generations]
    assert first.generations[0].text != first.generations[1].text
    assert first.effective_sampling.seed == 5


@pytest.mark.parametrize(
    ("constraint", "field", "reason"),
    [
        (
            schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
            "structured_output.json_schema.schema",
            "INVALID_SCHEMA",
        ),
        (
            t.StructuredOutput(json_schema=t.JsonSchema(schema_json="{broken")),
            "structured_output.json_schema.schema_json",
            "INVALID_SCHEMA",
        ),
        (
            t.StructuredOutput(regex=t.Regex(pattern="([a-z")),
            "structured_output.regex.pattern",
            "INVALID_REGEX",
        ),
        (t.StructuredOutput(choice=t.Choice()), "structured_output.choice.choices", "EMPTY_CHOICES"),
        (
            t.StructuredOutput(grammar=t.Grammar(syntax=t.GRAMMAR_SYNTAX_LARK, definition="start: foo(")),
            "structured_output.grammar.definition",
            "INVALID_GRAMMAR",
        ),
        (
            t.StructuredOutput(
                grammar=t.Grammar(syntax=t.GRAMMAR_SYNTAX_GBNF, definition="root ::= undefined_rule")
            ),
            "structured_output.grammar.definition",
            "INVALID_GRAMMAR",
        ),
    ],
)
async def test_bad_constraints_are_refused_with_the_field(
    stub: generation_pb2_grpc.GenerationServiceStub, constraint: t.StructuredOutput, field: str, reason: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(request(constraint))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
    assert status is not None
    info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
    for detail in status.details:
        if detail.Is(info.DESCRIPTOR):
            detail.Unpack(info)
        elif detail.Is(bad.DESCRIPTOR):
            detail.Unpack(bad)
    assert info.reason == reason
    assert [v.field for v in bad.field_violations] == [field]
    ok = await stub.Generate(request(t.StructuredOutput(choice=t.Choice(choices=["ok"]))))
    assert ok.generations[0].text == "ok"


async def test_worker_backed_model_is_healthy(tiny_server: RunningServer) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(tiny_server.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="gengate.v1.GenerationService/tiny")
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_unicode_property_classes_are_accepted_and_enforced(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    # \p{L} is valid for llguidance and the `regex` module (not Python's `re`): served, not refused.
    constraint = t.StructuredOutput(regex=t.Regex(pattern=r"\p{L}{2,6}"))
    reply = await stub.Generate(request(constraint, n=2, sampling=t.SamplingParams(seed=3)))
    import regex as regex_module

    for gen in reply.generations:
        assert gen.finish_reason == t.FINISH_REASON_STOP
        assert regex_module.fullmatch(r"\p{L}{2,6}", gen.text), gen.text
