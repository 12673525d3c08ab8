"""Constraints named in a model's config (`warm_constraints`), compiled when the model starts so
the first request with one is a cache hit instead of a compile (~10–60 ms, more on a large
vocabulary). The config form is the request's, in YAML:

    warm_constraints:
      - json_schema: {type: object, properties: {name: {type: string}}}   # or its JSON text
      - json_schema_file: /etc/gengate/schemas/person.json
      - regex: "[a-z]{3}-[0-9]{2}"
      - choice: [red, green, blue]
      - grammar: {syntax: lark, definition: 'start: "yes" | "no"'}
      - json_object: true
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gengate.domain import (
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuredOutput,
)
from gengate.errors import ConfigError, GengateError

_KINDS = ("json_schema", "json_schema_file", "regex", "choice", "grammar", "json_object")


class WarmGrammar(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    syntax: Literal["lark", "gbnf", "ebnf"] = "lark"
    definition: str = Field(min_length=1)


class WarmConstraint(BaseModel):
    """One constraint to compile at start: exactly one of its keys, as a request would send it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: dict[str, Any] | str | None = None
    json_schema_file: str | None = None
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: WarmGrammar | None = None
    json_object: bool = False

    @model_validator(mode="after")
    def _exactly_one(self) -> WarmConstraint:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(_KINDS)} (got {', '.join(given) or 'none'})")
        return self

    def structured(self) -> StructuredOutput:
        """The constraint as a request with default options carries it (so it hits the same key)."""
        return StructuredOutput(self._constraint())

    def _constraint(self) -> Constraint:
        if self.json_schema is not None or self.json_schema_file is not None:
            return JsonSchemaConstraint(self._schema())
        if self.regex is not None:
            return RegexConstraint(self.regex)
        if self.choice is not None:
            return ChoiceConstraint(tuple(self.choice))
        if self.grammar is not None:
            return GrammarConstraint(GrammarSyntax(self.grammar.syntax), self.grammar.definition)
        return JsonObjectConstraint()

    def _schema(self) -> dict[str, Any]:
        if isinstance(self.json_schema, dict):
            return self.json_schema
        source = self.json_schema_file or "json_schema"
        try:
            text = self.json_schema if self.json_schema is not None else Path(source).expanduser().read_text()
            schema = json.loads(text)
        except OSError as exc:
            raise ConfigError(f"json_schema_file {source!r}: cannot read it: {exc.strerror}") from exc
        except ValueError as exc:
            raise ConfigError(f"{source}: not JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise ConfigError(f"{source}: a JSON Schema is an object")
        return schema


class WarmableCompiler(Protocol):
    def warm(self, structured: StructuredOutput) -> None: ...


def warm_compiler(compiler: WarmableCompiler, constraints: list[WarmConstraint], model: str) -> None:
    """Compiles each constraint into the engine's cache (at load, in the loading thread); one that
    does not compile stops the start naming its entry — better now than at its first request."""
    for index, constraint in enumerate(constraints):
        try:
            compiler.warm(constraint.structured())
        except (GengateError, ConfigError) as exc:
            message = exc.message if isinstance(exc, GengateError) else str(exc)
            raise ConfigError(f"model {model!r}: warm_constraints[{index}]: {message}") from None
