"""Output types → StructuredOutput and back: pure conversions, no server."""

from __future__ import annotations

import enum
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

import pytest
from gengate_client import Choice, Grammar, JsonObject, JsonSchema, OutputValidationError, Regex
from gengate_client.output_types import resolve_output_type
from gengate_proto.v1 import types_pb2
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str
    population: int = Field(ge=0)
    country_code: str = Field(pattern=r"^[A-Z]{2}$")


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclass
class Point:
    x: int
    y: int


def schema_of(so: types_pb2.StructuredOutput) -> dict[str, object]:
    assert not so.json_schema.HasField("schema")  # sent as JSON text, order kept
    schema: dict[str, object] = json.loads(so.json_schema.schema_json)
    return schema


def test_pydantic_model_sends_its_schema_and_parses_an_instance() -> None:
    spec = resolve_output_type(City)
    assert spec is not None and spec.structured is not None
    assert spec.structured.WhichOneof("kind") == "json_schema"
    assert spec.structured.json_schema.name == "City"
    assert schema_of(spec.structured) == City.model_json_schema()
    city = spec.parse('{"name": "Paris", "population": 2161000, "country_code": "FR"}')
    assert city == City(name="Paris", population=2161000, country_code="FR")
    with pytest.raises(OutputValidationError) as info:
        spec.parse('{"name": "Paris", "population": -1, "country_code": "fr"}')
    assert "population" in str(info.value) and info.value.text.startswith("{")


def test_literal_becomes_a_choice_and_parses_back_to_the_value() -> None:
    spec = resolve_output_type(Literal["yes", "no"])
    assert spec is not None and spec.structured is not None
    assert list(spec.structured.choice.choices) == ["yes", "no"]
    assert spec.parse("no") == "no"
    with pytest.raises(OutputValidationError):
        spec.parse("maybe")
    numbers = resolve_output_type(Literal[1, 2, True])
    assert numbers is not None and numbers.structured is not None
    assert list(numbers.structured.choice.choices) == ["1", "2", "true"]
    assert numbers.parse("2") == 2 and numbers.parse("true") is True


def test_enum_classes_become_choices_and_parse_to_members() -> None:
    spec = resolve_output_type(Colour)
    assert spec is not None and spec.structured is not None
    assert list(spec.structured.choice.choices) == ["red", "green"]
    assert spec.parse("green") is Colour.GREEN
    levels = resolve_output_type(Level)
    assert levels is not None and levels.structured is not None
    assert list(levels.structured.choice.choices) == ["1", "2"]
    assert levels.parse("2") is Level.HIGH


def test_explicit_types() -> None:
    regex = resolve_output_type(Regex(r"\d{4}-\d{2}-\d{2}"))
    assert regex is not None and regex.structured is not None
    assert regex.structured.regex.pattern == r"\d{4}-\d{2}-\d{2}"
    assert regex.parse("2024-01-31") == "2024-01-31"

    grammar = resolve_output_type(Grammar('root ::= "a" | "b"', syntax="gbnf"))
    assert grammar is not None and grammar.structured is not None
    assert grammar.structured.grammar.syntax == types_pb2.GRAMMAR_SYNTAX_GBNF
    assert grammar.structured.grammar.definition == 'root ::= "a" | "b"'
    lark = resolve_output_type(Grammar("start: /[ab]/"))
    assert lark is not None and lark.structured is not None
    assert lark.structured.grammar.syntax == types_pb2.GRAMMAR_SYNTAX_LARK
    with pytest.raises(ValueError, match="syntax"):
        resolve_output_type(Grammar("x", syntax="peg"))  # type: ignore[arg-type]

    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}}, "required": ["a"]}
    js = resolve_output_type(JsonSchema(schema, name="A", strict=True))
    assert js is not None and js.structured is not None
    assert schema_of(js.structured) == schema
    assert js.structured.json_schema.strict and js.structured.json_schema.name == "A"
    assert js.parse('{"a": 2}') == {"a": 2}
    with pytest.raises(OutputValidationError, match="JSON"):
        js.parse('{"a": ')

    for value in (JsonObject(), dict):
        obj = resolve_output_type(value)
        assert obj is not None and obj.structured is not None
        assert obj.structured.WhichOneof("kind") == "json_object"

    choice = resolve_output_type(Choice(["x", "y"]))
    assert choice is not None and choice.structured is not None
    assert list(choice.structured.choice.choices) == ["x", "y"]


def test_plain_python_types_go_through_type_adapter() -> None:
    spec = resolve_output_type(int)
    assert spec is not None and spec.structured is not None
    assert schema_of(spec.structured) == {"type": "integer"}
    assert spec.parse("42") == 42
    with pytest.raises(OutputValidationError):
        spec.parse('"x"')
    lst = resolve_output_type(list[Point])
    assert lst is not None and lst.structured is not None
    assert lst.parse('[{"x": 1, "y": 2}]') == [Point(1, 2)]
    flag = resolve_output_type(bool)
    assert flag is not None and flag.parse("false") is False
    assert resolve_output_type(None) is None and resolve_output_type(str) is None


def test_unsupported_type_is_a_clear_type_error() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match="unsupported output_type"):
        resolve_output_type(Opaque)


def test_outlines_types_are_converted_when_outlines_is_installed() -> None:
    otypes = pytest.importorskip("outlines.types")
    regex = resolve_output_type(otypes.Regex(r"[0-9]{3}"))
    assert regex is not None and regex.structured is not None
    assert regex.structured.regex.pattern == "[0-9]{3}"
    cfg = resolve_output_type(otypes.CFG('start: "a"'))
    assert cfg is not None and cfg.structured is not None
    assert cfg.structured.grammar.syntax == types_pb2.GRAMMAR_SYNTAX_LARK
    js = resolve_output_type(otypes.JsonSchema(City))
    assert js is not None and js.structured is not None
    assert schema_of(js.structured) == json.loads(json.dumps(City.model_json_schema()))
    choice = resolve_output_type(otypes.Choice(["a", "b"]))
    assert choice is not None and choice.structured is not None
    assert list(choice.structured.choice.choices) == ["a", "b"]
    dsl = resolve_output_type(otypes.either("cat", "dog"))
    assert dsl is not None and dsl.structured is not None
    assert dsl.structured.WhichOneof("kind") == "regex"


def test_importing_the_client_imports_neither_outlines_nor_server_code() -> None:
    code = (
        "import sys, gengate_client, gengate_client.output_types;"
        "bad = [m for m in ('outlines', 'torch', 'gengate', 'transformers') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
