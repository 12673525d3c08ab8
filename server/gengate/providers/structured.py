"""Structured output for remote providers: plan (native / validated / refused), schema
transforms for provider restrictions, prompting, clean-up and validation of results.

Every structured result is validated against the caller's ORIGINAL constraint, whatever
enforced it; the re-ask loop lives in providers.base.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from gengate import errors
from gengate.constraints import kinds, schemas
from gengate.domain import (
    ConstraintKind,
    Enforcement,
    GrammarSyntax,
    JsonObjectConstraint,
)
from gengate.domain import (
    StructuredOutput as StructuredOutput,
)

if TYPE_CHECKING:  # referencing exports Resolver only from its core module
    from referencing._core import Resolver

StructuredSupport = Mapping[ConstraintKind, Enforcement]


def _identity(text: str) -> str:
    return text


@dataclass(frozen=True)
class StructuredPlan:
    """How one request's constraint is served by a provider.

    `native_schema` is the (possibly transformed) JSON Schema to send the provider; `unwrap`
    maps the provider's text back to what the caller asked for (e.g. strips wrapper objects
    and nulls added for strict mode); `instructions` is the prompt text describing the
    constraint when the provider does not enforce it itself."""

    structured: StructuredOutput
    enforcement: Enforcement
    native: bool
    native_schema: dict[str, Any] | None = None
    strict: bool = False
    unwrap: Callable[[str], str] = field(default=_identity)
    instructions: str | None = None

    @property
    def kind(self) -> ConstraintKind:
        return self.structured.constraint.kind


def refuse(kind: ConstraintKind, provider: str, why: str = "") -> errors.Unimplemented:
    """The up-front refusal for a constraint kind a provider cannot serve."""
    detail = f": {why}" if why else ""
    return errors.Unimplemented(
        f"{provider} cannot enforce or validate a {kind.value} constraint{detail}",
        reason="CONSTRAINT_UNSUPPORTED",
        metadata={"constraint_kind": kind.value, "provider": provider},
    )


def check_supported(
    structured: StructuredOutput,
    support: StructuredSupport,
    *,
    provider: str,
    grammar_syntaxes: frozenset[GrammarSyntax] = frozenset(),
) -> Enforcement:
    """The enforcement level for this constraint, or Unimplemented naming the kind and provider."""
    constraint = structured.constraint
    level = support.get(constraint.kind)
    if level is None:
        raise refuse(constraint.kind, provider)
    why = kinds.spec_of(structured).unserved_by(structured, grammar_syntaxes)
    if why:
        raise refuse(constraint.kind, provider, why)
    return level


# ---------------------------------------------------------------------------------------------
# Prompting for validated enforcement


def constraint_instructions(structured: StructuredOutput) -> str:
    """A system-prompt paragraph describing the constraint, for providers that do not enforce it
    (its kind's spec writes it)."""
    return kinds.constraint_instructions(structured)


def reask_message(error: str) -> str:
    """The user message that asks again after a validation failure."""
    return (
        f"That answer is not valid: {error}\n"
        "Answer again, following the required format exactly, with nothing else."
    )


def clean_output(structured: StructuredOutput, text: str) -> str:
    """Light clean-up of a prompted (not enforced) answer: code fences, whitespace, quotes (its
    kind's spec knows which)."""
    return kinds.spec_of(structured).tidy_prompted(structured, text)


# ---------------------------------------------------------------------------------------------
# JSON Schema for providers with OpenAI-style strict mode

# Keywords strict mode rejects; dropped from the wire schema (the result is still validated
# against the original, and reported VALIDATED rather than NATIVE).
STRICT_UNSUPPORTED = frozenset(
    {
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "patternProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "contentEncoding",
        "contentMediaType",
        "$schema",
        "$id",
        "examples",
        "default",
    }
)
# The keywords strict mode keeps whose subschemas are transformed too.
_STRICT_CHILDREN = frozenset({"properties", "$defs", "definitions", "anyOf", "oneOf", "prefixItems", "items"})
_WRAP_KEY = "value"


@dataclass
class _StrictResult:
    schema: dict[str, Any]
    relaxed: bool = False  # something was dropped or loosened: enforcement is VALIDATED


def _nullable(schema: Any) -> dict[str, Any]:
    if not isinstance(schema, dict):
        return {"anyOf": [{"type": "null"}]}
    out = dict(schema)
    t = out.get("type")
    if isinstance(t, str) and "enum" not in out and "const" not in out:
        out["type"] = [t, "null"]
    elif isinstance(t, list) and "enum" not in out and "const" not in out:
        if "null" not in t:
            out["type"] = [*t, "null"]
    else:
        out = {"anyOf": [schema, {"type": "null"}]}
    return out


def _strictify(schema: Any, result: _StrictResult) -> Any:
    """The schema under OpenAI strict rules (`result.relaxed` set when something was lost)."""

    def strict_node(node: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in STRICT_UNSUPPORTED:
                if key not in ("$schema", "$id", "examples", "default"):
                    result.relaxed = True
                continue
            if key == "oneOf" and isinstance(value, list):
                out["anyOf"] = value  # strict mode has no oneOf: served as anyOf, checked afterwards
                result.relaxed = True
            elif key in _STRICT_CHILDREN:
                out[key] = value  # already transformed by the walk
            else:
                out[key] = copy.deepcopy(value)
        if out.get("type") == "object" or "properties" in out:
            extra = node.get("additionalProperties")
            if extra not in (None, False):
                result.relaxed = True  # free-form maps cannot be strict; keys beyond properties are lost
            props: dict[str, Any] = out.get("properties", {})
            required = set(node.get("required", ()))
            out["properties"] = {k: (v if k in required else _nullable(v)) for k, v in props.items()}
            out["required"] = list(props)
            out["additionalProperties"] = False
            out.setdefault("type", "object")
        return out

    return schemas.rewrite(schema, strict_node, descend=lambda keyword: keyword in _STRICT_CHILDREN)


def openai_strict_schema(schema: dict[str, Any]) -> tuple[dict[str, Any], bool, bool]:
    """The schema transformed for OpenAI strict mode: (wire_schema, wrapped_root, relaxed).

    Optional properties become required-and-nullable (nulls are stripped from results by
    `strip_added_nulls`); a non-object root is wrapped as {"value": ...}; unsupported keywords
    are dropped and `relaxed` says the result must be reported as VALIDATED."""
    result = _StrictResult(schema={})
    root_is_object = schema.get("type") == "object" or ("properties" in schema and "type" not in schema)
    if root_is_object and not any(k in schema for k in ("anyOf", "oneOf")):
        return _strictify(schema, result), False, result.relaxed
    return _strictify(wrapped_in_object(schema), result), True, result.relaxed


def wrapped_in_object(schema: dict[str, Any]) -> dict[str, Any]:
    """{"value": schema} as an object schema, for providers whose native JSON needs an object
    root; definitions stay at the root, where the schema's `$ref`s point."""
    defs: dict[str, Any] = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    inner = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    return {"type": "object", "properties": {_WRAP_KEY: inner}, "required": [_WRAP_KEY], **defs}


_NOT_WRAPPED = object()


def unwrapped_value(text: str) -> Any:
    """The value inside an answer to `wrapped_in_object`, or _NOT_WRAPPED when the text is not
    one (left for validation to report)."""
    try:
        value = json.loads(text)
    except ValueError:
        return _NOT_WRAPPED
    if not isinstance(value, dict) or _WRAP_KEY not in value:
        return _NOT_WRAPPED
    return value[_WRAP_KEY]


def _json_answer(text: str, wrapped: bool) -> Any:
    """The JSON value of a provider's answer (inside the wrapper when `wrapped`), or _NOT_WRAPPED."""
    if wrapped:
        return unwrapped_value(text)
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_WRAPPED


# Chains of $ref longer than this (or a cycle) resolve to nothing, as an unresolvable one does.
MAX_REF_HOPS = 32


def _resolve(node: Any, resolver: Resolver[Any]) -> Any:
    """`node` with its `$ref`s followed (referencing: JSON pointers, anchors, `$id`s of the root)."""
    for _ in range(MAX_REF_HOPS):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)):
            return node
        try:
            resolved = resolver.lookup(node["$ref"])
        except Unresolvable:
            return {}
        node, resolver = resolved.contents, resolved.resolver
    return {}


def _allows_null(node: Any, resolver: Resolver[Any]) -> bool:
    node = _resolve(node, resolver)
    if not isinstance(node, dict):
        return True
    t = node.get("type")
    if t == "null" or (isinstance(t, list) and "null" in t):
        return True
    if "enum" in node and None in node["enum"]:
        return True
    if "const" in node and node["const"] is None:
        return True
    return any(_allows_null(s, resolver) for key in ("anyOf", "oneOf") for s in node.get(key, ()))


def strip_added_nulls(value: Any, schema: Any, root: dict[str, Any]) -> Any:
    """Removes object keys that are null only because strict mode forced them in (optional in
    the original schema, and null not allowed there); `$ref`s resolve against `root`."""
    resource = Resource.from_contents(root, default_specification=DRAFT202012)
    return _strip(value, schema, Registry().with_resource("", resource).resolver())


def _strip(value: Any, schema: Any, resolver: Resolver[Any]) -> Any:
    schema = _resolve(schema, resolver)
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        out = {}
        for key, item in value.items():
            sub = props.get(key)
            if item is None and key not in required and sub is not None and not _allows_null(sub, resolver):
                continue
            out[key] = _strip(item, sub, resolver) if sub is not None else item
        return out
    if isinstance(value, list):
        items = schema.get("items")
        prefix = schema.get("prefixItems", [])
        return [_strip(v, prefix[i] if i < len(prefix) else items, resolver) for i, v in enumerate(value)]
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key, ()):
            option = _resolve(option, resolver)
            if isinstance(option, dict) and (
                (isinstance(value, dict) and (option.get("type") == "object" or "properties" in option))
                or (isinstance(value, list) and option.get("type") == "array")
            ):
                return _strip(value, option, resolver)
    return value


def plan_openai_style(
    structured: StructuredOutput,
    level: Enforcement,
    *,
    strict_transform: bool,
) -> StructuredPlan:
    """A plan for providers that take a JSON Schema in OpenAI's `response_format` shape.

    Choice constraints become a JSON Schema enum wrapped in an object (unwrapped again), so
    they are native wherever JSON Schema is; `strict_transform` applies OpenAI strict rules."""
    if level != Enforcement.NATIVE:
        return StructuredPlan(
            structured, level, native=False, instructions=constraint_instructions(structured)
        )
    if isinstance(structured.constraint, JsonObjectConstraint):
        return StructuredPlan(structured, Enforcement.NATIVE, native=True)
    spec = kinds.spec_of(structured)
    schema = spec.as_json_schema(structured)
    if schema is None:
        return StructuredPlan(structured, level, native=True)
    if not strict_transform:
        return StructuredPlan(
            structured,
            Enforcement.NATIVE,
            native=True,
            native_schema=schema,
            strict=False,
            unwrap=spec.from_json_text,
        )
    wire, wrapped, relaxed = openai_strict_schema(schema)

    def unwrap(text: str) -> str:
        value = _json_answer(text, wrapped)
        if value is _NOT_WRAPPED:
            return text  # validation reports it
        return spec.from_json_answer(strip_added_nulls(value, schema, schema))

    return StructuredPlan(
        structured,
        Enforcement.VALIDATED if relaxed else Enforcement.NATIVE,
        native=True,
        native_schema=wire,
        strict=True,
        unwrap=unwrap,
    )


def plan_object_root(
    structured: StructuredOutput,
    level: Enforcement,
    *,
    transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    relaxed: Callable[[dict[str, Any]], bool] | None = None,
) -> StructuredPlan:
    """A plan for providers whose native JSON Schema needs an object root (Anthropic, Cohere,
    Gemini...): choices become an enum, a non-object root is wrapped as {"value": ...} and
    unwrapped again; `transform` adapts the wire schema (ValueError: prompt + validate instead)
    and `relaxed(schema)` says the provider would not enforce all of it (report VALIDATED)."""
    prompted = StructuredPlan(
        structured,
        Enforcement.VALIDATED if level == Enforcement.NATIVE else level,
        native=False,
        instructions=constraint_instructions(structured),
    )
    if level != Enforcement.NATIVE:
        return prompted
    if isinstance(structured.constraint, JsonObjectConstraint):
        return StructuredPlan(structured, Enforcement.NATIVE, native=True)
    spec = kinds.spec_of(structured)
    schema = spec.as_json_schema(structured)
    if schema is None:
        return StructuredPlan(structured, level, native=True)
    wrapped = schema.get("type") != "object"
    root = wrapped_in_object(schema) if wrapped else schema
    try:
        wire = transform(root) if transform is not None else root
    except (ValueError, TypeError, KeyError, AssertionError):
        return prompted

    def unwrap(text: str) -> str:
        value = unwrapped_value(text) if wrapped else _NOT_WRAPPED
        return text if value is _NOT_WRAPPED else spec.from_json_answer(value)

    level = Enforcement.VALIDATED if relaxed is not None and relaxed(schema) else Enforcement.NATIVE
    return StructuredPlan(structured, level, native=True, native_schema=wire, unwrap=unwrap)
