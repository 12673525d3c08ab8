"""Output types: what `output_type=` accepts, turned into a `StructuredOutput` plus a parser.

Accepted: a pydantic model class, `Literal[...]`, an `Enum` class, the explicit `Regex`,
`Grammar`, `JsonSchema`, `JsonObject`, `Choice` below, any type pydantic's TypeAdapter can
describe (int, float, bool, list[...], dataclasses, TypedDicts), `dict` (any JSON object), `str`
(plain text), and Outlines' own output types (recognised by duck typing; outlines is never
imported here unless the value already comes from it).
"""

from __future__ import annotations

import enum
import json
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic
from gengate_proto.v1 import types_pb2

from gengate_client.errors import OutputValidationError

GrammarSyntaxName = Literal["lark", "gbnf", "ebnf"]
_SYNTAX = {
    "lark": types_pb2.GRAMMAR_SYNTAX_LARK,
    "gbnf": types_pb2.GRAMMAR_SYNTAX_GBNF,
    "ebnf": types_pb2.GRAMMAR_SYNTAX_EBNF,
}


@dataclass(frozen=True)
class Regex:
    """Output must fully match this regular expression; parsed back as the matched text."""

    pattern: str


@dataclass(frozen=True)
class Grammar:
    """Output must be a sentence of this grammar (Lark by default, or GBNF / EBNF)."""

    definition: str
    syntax: GrammarSyntaxName = "lark"


@dataclass(frozen=True)
class JsonSchema:
    """Output must be JSON valid against this schema; parsed back with `json.loads`."""

    schema: Mapping[str, Any]
    name: str = ""
    strict: bool = False


@dataclass(frozen=True)
class JsonObject:
    """Output must be some JSON object; parsed back with `json.loads`."""


@dataclass(frozen=True)
class Choice:
    """Output must be exactly one of these strings."""

    choices: Sequence[str]


@dataclass(frozen=True)
class OutputSpec:
    """A resolved output type: the proto constraint (None = plain text) and how to parse text."""

    structured: types_pb2.StructuredOutput | None
    parse: Callable[[str], Any] = field(compare=False)


def _identity(text: str) -> str:
    return text


def _json_loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise OutputValidationError(f"output is not valid JSON: {exc}", text=text) from exc


def _schema_json(schema: Mapping[str, Any]) -> str:
    """Schemas travel as JSON text: a Struct would lose property order and exact integers."""
    return json.dumps(schema)


def _json_schema_spec(schema: Mapping[str, Any], parse: Callable[[str], Any], name: str = "") -> OutputSpec:
    kind = types_pb2.JsonSchema(schema_json=_schema_json(schema), name=name)
    return OutputSpec(types_pb2.StructuredOutput(json_schema=kind), parse)


def _choice_spec(choices: Sequence[str], lookup: Mapping[str, Any] | None = None) -> OutputSpec:
    choices = list(choices)

    def parse(text: str) -> Any:
        if text not in choices:
            raise OutputValidationError(f"output {text!r} is not one of {choices}", text=text)
        return lookup[text] if lookup is not None else text

    return OutputSpec(types_pb2.StructuredOutput(choice=types_pb2.Choice(choices=choices)), parse)


def _regex_spec(pattern: str) -> OutputSpec:
    return OutputSpec(types_pb2.StructuredOutput(regex=types_pb2.Regex(pattern=pattern)), _identity)


def _grammar_spec(definition: str, syntax: str) -> OutputSpec:
    if syntax not in _SYNTAX:
        raise ValueError(f"grammar syntax must be one of {sorted(_SYNTAX)}, not {syntax!r}")
    grammar = types_pb2.Grammar(syntax=_SYNTAX[syntax], definition=definition)
    return OutputSpec(types_pb2.StructuredOutput(grammar=grammar), _identity)


def _adapter_parser(adapter: pydantic.TypeAdapter[Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return adapter.validate_json(text)
        except pydantic.ValidationError as exc:
            raise OutputValidationError(f"output does not validate: {exc}", text=text) from exc

    return parse


def _model_parser(model: type[pydantic.BaseModel]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return model.model_validate_json(text)
        except pydantic.ValidationError as exc:
            raise OutputValidationError(
                f"output does not validate as {model.__name__}: {exc}", text=text
            ) from exc

    return parse


def _literal_spec(values: Sequence[Any]) -> OutputSpec:
    lookup = {
        v if isinstance(v, str) else json.dumps(v.value if isinstance(v, enum.Enum) else v): v for v in values
    }
    return _choice_spec(list(lookup), lookup)


def _outlines_spec(value: Any) -> OutputSpec | None:
    """Converts Outlines' DSL terms (outlines.types.Regex, JsonSchema, Choice, CFG, others)."""
    cls = type(value)
    if not cls.__module__.startswith("outlines."):
        return None
    name = cls.__name__
    if name == "Regex":
        return _regex_spec(value.pattern)
    if name == "CFG":
        return _grammar_spec(value.definition, "lark")
    if name == "JsonSchema":
        schema = json.loads(value.schema) if isinstance(value.schema, str) else dict(value.schema)
        return _json_schema_spec(schema, _json_loads)
    if name == "Choice":
        items = list(value.items)
        return _literal_spec(items)
    if name == "String":
        return _choice_spec([value.value])
    # Any other term (Alternatives, Sequence, quantifiers...) is a regular language.
    from outlines.types.dsl import to_regex

    return _regex_spec(to_regex(value))


def resolve_output_type(output_type: Any) -> OutputSpec | None:
    """Turns an `output_type=` value into a constraint and a parser; None means plain text."""
    if output_type is None or output_type is str:
        return None
    if isinstance(output_type, OutputSpec):
        return output_type
    if isinstance(output_type, Regex):
        return _regex_spec(output_type.pattern)
    if isinstance(output_type, Grammar):
        return _grammar_spec(output_type.definition, output_type.syntax)
    if isinstance(output_type, JsonSchema):
        kind = types_pb2.JsonSchema(
            schema_json=_schema_json(output_type.schema), name=output_type.name, strict=output_type.strict
        )
        return OutputSpec(types_pb2.StructuredOutput(json_schema=kind), _json_loads)
    if isinstance(output_type, JsonObject) or output_type is dict:
        return OutputSpec(types_pb2.StructuredOutput(json_object=types_pb2.JsonObject()), _json_loads)
    if isinstance(output_type, Choice):
        return _choice_spec(output_type.choices)
    if isinstance(output_type, types_pb2.StructuredOutput):
        return OutputSpec(output_type, _identity)
    outlines_spec = _outlines_spec(output_type)
    if outlines_spec is not None:
        return outlines_spec
    if typing.get_origin(output_type) is Literal:
        return _literal_spec(typing.get_args(output_type))
    if isinstance(output_type, type) and issubclass(output_type, enum.Enum):
        members = list(output_type)
        lookup = {m.value if isinstance(m.value, str) else json.dumps(m.value): m for m in members}
        return _choice_spec(list(lookup), lookup)
    if isinstance(output_type, type) and issubclass(output_type, pydantic.BaseModel):
        return _json_schema_spec(
            output_type.model_json_schema(), _model_parser(output_type), output_type.__name__
        )
    try:
        adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(output_type)
        schema = adapter.json_schema()
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, TypeError) as exc:
        raise TypeError(f"unsupported output_type {output_type!r}: {exc}") from exc
    name = getattr(output_type, "__name__", "")
    return _json_schema_spec(schema, _adapter_parser(adapter), name if isinstance(name, str) else "")
