"""`warm_constraints`: constraints named in a local model's config are compiled when it starts and
checked by the sandbox, so the first request with one is a compile-cache hit (metrics: the engine's
compile cache and the server's constraint checks, scraped after the call), over gRPC on the tiny
llama.cpp model in its worker process. A constraint that does not compile stops the start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from gengate.config import parse_config
from gengate.errors import ConfigError
from gengate.workers.backend import WorkerStartError
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from metrics_scrape import scrape
from observe import ServerFactory

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def tiny(**options: Any) -> dict[str, Any]:
    return {
        "models": [{"name": "tiny", "backend": "llamacpp", "tiny": True, **options}],
        "server": {"metrics": {"port": 0}},
    }


def schema_output(schema: dict[str, Any]) -> t.StructuredOutput:
    """As the clients send a schema: its JSON text, key order kept (the order fields generate in)."""
    return t.StructuredOutput(json_schema=t.JsonSchema(schema_json=json.dumps(schema)))


async def test_a_warm_constraints_first_request_is_a_cache_hit(
    make_server: ServerFactory, tmp_path: Path
) -> None:
    schema_file = tmp_path / "ok.json"
    schema_file.write_text(json.dumps(SCHEMA))
    warm = [
        {"regex": "[a-z]{3}-[0-9]{2}"},
        {"json_schema_file": str(schema_file)},
        {"choice": ["red", "blue"]},
    ]
    server = await make_server(tiny(warm_constraints=warm))
    requests = [
        t.StructuredOutput(regex=t.Regex(pattern="[a-z]{3}-[0-9]{2}")),
        schema_output(SCHEMA),
        t.StructuredOutput(choice=t.Choice(choices=["red", "blue"])),
        t.StructuredOutput(regex=t.Regex(pattern="[0-9]{4}")),  # not warmed: compiled for its call
    ]
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for structured in requests:
            stopping = t.StoppingCriteria(max_tokens=24)
            await stub.Generate(
                g.GenerateRequest(model="tiny", prompt="x", structured_output=structured, stopping=stopping)
            )
    m = await scrape(server)
    assert m.value("gengate_constraint_compile_cache_total", model="tiny", result="hit") == 3
    assert m.value("gengate_constraint_compile_cache_total", model="tiny", result="miss") == 1
    assert m.value("gengate_constraint_checks_total", result="cached") == 3  # the sandbox's verdicts too


async def test_a_warm_constraint_that_does_not_compile_stops_the_start(make_server: ServerFactory) -> None:
    with pytest.raises(WorkerStartError) as caught:
        await make_server(tiny(warm_constraints=[{"choice": ["a"]}, {"regex": "(unclosed"}]))
    first_line = str(caught.value).splitlines()[0]
    assert "model 'tiny': warm_constraints[1]: structured_output.regex.pattern" in first_line
    assert "unclosed group" in first_line


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({}, "exactly one"),
        ({"regexp": "a"}, "regexp"),
        ({"grammar": {"syntax": "peg", "definition": "x"}}, "syntax"),
    ],
)
def test_a_malformed_entry_is_a_config_error(entry: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_config(
            {"models": [{"name": "m", "backend": "llamacpp", "tiny": True, "warm_constraints": [entry]}]}
        )
