"""One spec per structured-output constraint kind: everything the server does that depends on
the kind, in one place.

A spec owns, for its kind: the request fields that name it (the `structured_output` oneof field,
and the field holding its content), the reason a grammar engine's refusal carries, the request
limits of its content, the cheap shape checks done before anything reads the content, the
content's syntax check (run in the sandbox), lowering to an llguidance grammar, validation of a
finished output, and the prompt text for providers that only validate. The generic parts stay
helpers where they were: the linear scanners in gengate.limits, JSON Schema relaxation and the
grammar checks in lowering, the linear-time matchers in validation, in syntax the regex reader.

Adding a kind is one ConstraintSpec subclass and its row in SPECS (plus its domain class, its
contract message and its conversion). Which kinds a backend serves natively, and how, stays the
backend's (each provider's table, an engine's mapping).

The functions at the end are what other modules call; each asks the kind's spec.
"""

from __future__ import annotations

import dataclasses
import json
import re
from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

from llguidance import LLMatcher

from gengate import errors
from gengate.constraints import lowering, syntax, validation
from gengate.constraints.lowering import LoweredConstraint
from gengate.constraints.regex_dialect import ascii_shorthands
from gengate.constraints.schemas import without_annotations
from gengate.domain import (
    ChoiceConstraint,
    Constraint,
    ConstraintKind,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    ModelCapabilities,
    RegexConstraint,
    StructuredOutput,
)
from gengate.errors import FieldViolation
from gengate.limits import (
    RequestLimits,
    grammar_parts,
    grammar_rule_count,
    json_shape,
    over_constraint_bytes,
    over_limit,
    regex_shape,
    regex_violations,
    schema_patterns,
    text_bytes,
    texts_bytes,
)

C = TypeVar("C", bound=Constraint)

# Weights saturate here (constraint_weight): a cache weighs, it does not need exact sizes.
_WEIGHT_CAP = 10**9


class ConstraintSpec(ABC, Generic[C]):
    """What the server does with constraints of one kind. One instance per kind, in SPECS.

    Methods reading only the constraint's content take the constraint; those that also depend on
    the compile options (whitespace, additional_properties) take the StructuredOutput.
    """

    kind: ConstraintKind
    constraint_type: type[C]
    # The `structured_output` oneof field of this kind (a refusal of the kind names it).
    field: str
    # The field holding the constraint's content (a refusal of the content names it).
    content_field: str
    # The reason of a refusal by the grammar engine (the compiler's, with a real tokenizer).
    invalid_reason: str

    def constraint(self, structured: StructuredOutput | Constraint) -> C:
        """The constraint, as this kind's class (TypeError when it is another kind's)."""
        c = structured.constraint if isinstance(structured, StructuredOutput) else structured
        if not isinstance(c, self.constraint_type):
            raise TypeError(f"the {self.kind.value} spec was given a {c.kind.value} constraint")
        return c

    def limit_violations(self, constraint: C, limits: RequestLimits) -> list[FieldViolation]:
        """The size, count, nesting and expansion limits the content exceeds (at most one).
        Linear in the content and safe on the event loop (gengate.limits' scanners)."""
        return []

    def weight(self, constraint: C) -> int:
        """About the grammar-engine states the compiled constraint holds, for weighing caches."""
        return 1

    def cache_fields(self, constraint: C, *, grammar_only: bool = False) -> dict[str, Any]:
        """The constraint's fields as a cache keys them. `grammar_only`: what can change the
        compiled grammar (for compile caches), not what a schema check reads."""
        return {f.name: getattr(constraint, f.name) for f in dataclasses.fields(constraint)}

    def check_shape(self, structured: StructuredOutput, caps: ModelCapabilities) -> None:
        """Refuses a constraint malformed on its face (empty, or options it cannot take); cheap,
        reads no content beyond its size. Runs once the model has declared the kind."""

    def check_syntax(self, structured: StructuredOutput) -> None:
        """Refuses content that is not well-formed (InvalidArgument naming the field). Runs
        library code on the content: in the sandbox (gengate.constraints.sandbox)."""

    @abstractmethod
    def lower(self, structured: StructuredOutput, *, syntax_checked: bool = False) -> LoweredConstraint:
        """The llguidance grammar, or InvalidArgument naming the field. `syntax_checked`: the
        caller ran check_syntax on this constraint already, so what it checks is not checked again."""

    @abstractmethod
    def validate(self, structured: StructuredOutput, text: str) -> str | None:
        """None when `text` satisfies the constraint, else a short reason (linear-time matchers)."""

    def validates_cheaply(self, structured: StructuredOutput) -> bool:
        """True when validating a short output (validation.CHEAP_TEXT_CHARS) costs microseconds
        whatever the constraint holds, so it may run inline."""
        return False

    @abstractmethod
    def instructions(self, structured: StructuredOutput) -> str:
        """The system-prompt paragraph describing the constraint, for a provider that does not
        enforce it (the answer is validated)."""

    def tidy_prompted(self, structured: StructuredOutput, text: str) -> str:
        """A prompted (not enforced) answer with the wrapping models add around it removed, before
        it is validated: code fences around JSON, quotes around a choice."""
        return text

    def unserved_by(self, structured: StructuredOutput, grammar_syntaxes: frozenset[GrammarSyntax]) -> str:
        """Why a provider that declares this kind still cannot serve this constraint ("" when it
        can): e.g. a grammar in a syntax it does not take."""
        return ""

    def as_json_schema(self, structured: StructuredOutput) -> dict[str, Any] | None:
        """The constraint as a JSON Schema, for providers whose native structured output is JSON
        Schema (None when the kind has no such form)."""
        return None

    def from_json_answer(self, value: Any) -> str:
        """The caller's text for the JSON value a provider answered `as_json_schema` with."""
        return json.dumps(value, ensure_ascii=False)

    def from_json_text(self, text: str) -> str:
        """The caller's text for a provider's JSON answer to `as_json_schema`, taken as it came
        (not strict mode: nothing was added to unwrap)."""
        return text


class JsonSchemaSpec(ConstraintSpec[JsonSchemaConstraint]):
    kind = ConstraintKind.JSON_SCHEMA
    constraint_type = JsonSchemaConstraint
    field = "structured_output.json_schema"
    content_field = "structured_output.json_schema.schema"
    invalid_reason = "UNSUPPORTED_SCHEMA"

    def limit_violations(
        self, constraint: JsonSchemaConstraint, limits: RequestLimits
    ) -> list[FieldViolation]:
        field, schema = self.content_field, constraint.schema
        shape = json_shape(schema, stop_at_bytes=limits.max_constraint_bytes)
        if shape.size > limits.max_constraint_bytes:
            what = "the schema's size in bytes (as JSON)"
            return [over_constraint_bytes(field, what, shape.size, limits)]
        if shape.depth > limits.max_schema_depth:
            what = "the schema's nesting depth"
            return [over_limit(field, what, shape.depth, "max_schema_depth", limits.max_schema_depth)]
        if shape.refs > limits.max_schema_refs:
            what = "the number of $ref in the schema"
            return [over_limit(field, what, shape.refs, "max_schema_refs", limits.max_schema_refs)]
        if shape.unreadable:
            return [FieldViolation(field, "holds a value that is not JSON (a number too long, or not JSON)")]
        for where, pattern in schema_patterns(schema):
            found = regex_violations(f"{field}{where}", pattern, limits, check_bytes=False)
            if found:
                return found
        return []

    def cache_fields(self, constraint: JsonSchemaConstraint, *, grammar_only: bool = False) -> dict[str, Any]:
        fields = super().cache_fields(constraint)
        if grammar_only:  # annotations (title, description, ...) never change the grammar
            fields["schema"] = without_annotations(constraint.schema)
        return fields

    def weight(self, constraint: JsonSchemaConstraint) -> int:
        schema = constraint.schema
        patterns = sum(regex_shape(p, cap=_WEIGHT_CAP).expansion for _, p in schema_patterns(schema))
        return max(1, json_shape(schema).size // 64 + patterns)

    def check_syntax(self, structured: StructuredOutput) -> None:
        schema = self.constraint(structured).schema
        lowering.check_schema(schema, self.content_field)
        if syntax.uses(schema, "unevaluatedProperties") and syntax.uses(schema, "patternProperties"):
            # jsonschema finds the properties patternProperties evaluated with Python's backtracking
            # `re`, which this server runs on no caller pattern.
            raise errors.InvalidArgument.field(
                self.content_field,
                "unevaluatedProperties together with patternProperties is not supported",
                reason="UNSUPPORTED_SCHEMA",
            )
        for where, pattern in schema_patterns(schema):
            problem = validation.linear_regex_error(pattern)
            if problem is not None:
                raise errors.InvalidArgument.field(
                    f"{self.content_field}{where}",
                    f"invalid or unsupported regex: {problem}",
                    reason="INVALID_SCHEMA",
                )

    def lower(self, structured: StructuredOutput, *, syntax_checked: bool = False) -> LoweredConstraint:
        return lowering.lower_json_schema(
            self.constraint(structured), structured, field=self.content_field, metaschema=not syntax_checked
        )

    def validate(self, structured: StructuredOutput, text: str) -> str | None:
        c = self.constraint(structured)
        return validation.validate_json(text, validation.schema_validator(c, structured))

    def tidy_prompted(self, structured: StructuredOutput, text: str) -> str:
        return _unfenced(text)

    def as_json_schema(self, structured: StructuredOutput) -> dict[str, Any] | None:
        return self.constraint(structured).schema

    def instructions(self, structured: StructuredOutput) -> str:
        schema = self.constraint(structured).schema
        return (
            "Answer with only one JSON value that is valid against this JSON Schema: no prose, "
            "no Markdown code fences.\nJSON Schema:\n" + json.dumps(schema, indent=None, sort_keys=True)
        )


class JsonObjectSpec(ConstraintSpec[JsonObjectConstraint]):
    kind = ConstraintKind.JSON_OBJECT
    constraint_type = JsonObjectConstraint
    field = "structured_output.json_object"
    # JsonObject has no content; refusals name the schema field, as they always have.
    content_field = "structured_output.json_schema.schema"
    invalid_reason = "UNSUPPORTED_SCHEMA"

    def check_shape(self, structured: StructuredOutput, caps: ModelCapabilities) -> None:
        if structured.additional_properties is False:
            raise errors.InvalidArgument.field(
                "structured_output.options.additional_properties",
                "must not be false for json_object (an object without properties could only be {})",
                reason="INVALID_OPTIONS",
            )

    def lower(self, structured: StructuredOutput, *, syntax_checked: bool = False) -> LoweredConstraint:
        schema: dict[str, Any] = {"type": "object"}
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=lowering.json_options(structured))
        lowering.check_grammar(grammar, self.content_field, "INVALID_SCHEMA")
        return LoweredConstraint(self.kind, grammar, schema=schema, generate_schema=schema)

    def validate(self, structured: StructuredOutput, text: str) -> str | None:
        return validation.validate_json(text, validation.any_object_validator())

    def validates_cheaply(self, structured: StructuredOutput) -> bool:
        return True

    def instructions(self, structured: StructuredOutput) -> str:
        return "Answer with only one valid JSON object: no prose, no Markdown code fences."

    def tidy_prompted(self, structured: StructuredOutput, text: str) -> str:
        return _unfenced(text)


class RegexSpec(ConstraintSpec[RegexConstraint]):
    kind = ConstraintKind.REGEX
    constraint_type = RegexConstraint
    field = "structured_output.regex"
    content_field = "structured_output.regex.pattern"
    invalid_reason = "INVALID_REGEX"

    def limit_violations(self, constraint: RegexConstraint, limits: RequestLimits) -> list[FieldViolation]:
        return regex_violations(self.content_field, constraint.pattern, limits, check_bytes=True)

    def weight(self, constraint: RegexConstraint) -> int:
        return max(1, regex_shape(constraint.pattern, cap=_WEIGHT_CAP).expansion)

    def check_shape(self, structured: StructuredOutput, caps: ModelCapabilities) -> None:
        if not self.constraint(structured).pattern:
            raise errors.InvalidArgument.field(
                self.content_field, "must not be empty", reason="INVALID_REGEX"
            )

    def check_syntax(self, structured: StructuredOutput) -> None:
        problem = syntax.regex_syntax_error(self.constraint(structured).pattern)
        if problem is not None:
            raise errors.InvalidArgument.field(
                self.content_field, f"invalid regular expression: {problem}", reason="INVALID_REGEX"
            )

    def lower(self, structured: StructuredOutput, *, syntax_checked: bool = False) -> LoweredConstraint:
        # Checked again even after check_syntax: RE2 reading a pattern does not mean llguidance does.
        grammar = LLMatcher.grammar_from_regex(ascii_shorthands(self.constraint(structured).pattern))
        lowering.check_grammar(grammar, self.content_field, "INVALID_REGEX", what="invalid regex")
        return LoweredConstraint(self.kind, grammar)

    def validate(self, structured: StructuredOutput, text: str) -> str | None:
        return validation.validate_regex(self.constraint(structured).pattern, text)

    def validates_cheaply(self, structured: StructuredOutput) -> bool:
        # RE2 is linear; a pattern only llguidance reads is walked byte by byte, in the pool.
        return validation.compile_regex(self.constraint(structured).pattern) is not None

    def instructions(self, structured: StructuredOutput) -> str:
        return (
            "Answer with only text that fully matches this regular expression, nothing before or after "
            f"it: {ascii_shorthands(self.constraint(structured).pattern)}"
        )


class ChoiceSpec(ConstraintSpec[ChoiceConstraint]):
    kind = ConstraintKind.CHOICE
    constraint_type = ChoiceConstraint
    field = "structured_output.choice"
    content_field = "structured_output.choice.choices"
    invalid_reason = "INVALID_CHOICES"

    def limit_violations(self, constraint: ChoiceConstraint, limits: RequestLimits) -> list[FieldViolation]:
        count = len(constraint.choices)
        if count > limits.max_choices:
            return [
                over_limit(
                    self.content_field, "the number of choices", count, "max_choices", limits.max_choices
                )
            ]
        size = texts_bytes(constraint.choices, limits.max_constraint_bytes)
        if size > limits.max_constraint_bytes:
            return [
                over_constraint_bytes(self.content_field, "the choices' total size in bytes", size, limits)
            ]
        return []

    def weight(self, constraint: ChoiceConstraint) -> int:
        return max(1, sum(len(c) for c in constraint.choices) // 8)

    def check_shape(self, structured: StructuredOutput, caps: ModelCapabilities) -> None:
        choices = self.constraint(structured).choices
        if not choices:
            raise errors.InvalidArgument.field(
                self.content_field, "must list at least one choice", reason="EMPTY_CHOICES"
            )
        if any(c == "" for c in choices):
            raise errors.InvalidArgument.field(
                self.content_field, "choices must not be empty strings", reason="EMPTY_CHOICES"
            )

    def lower(self, structured: StructuredOutput, *, syntax_checked: bool = False) -> LoweredConstraint:
        choices = self.constraint(structured).choices
        if not choices:
            raise errors.InvalidArgument.field(
                self.content_field, "the choice list is empty", reason="EMPTY_CHOICES"
            )
        grammar = LLMatcher.grammar_from_lark(lowering.choice_lark(choices))
        lowering.check_grammar(grammar, self.content_field, "INVALID_CHOICES")
        return LoweredConstraint(self.kind, grammar)

    def validate(self, structured: StructuredOutput, text: str) -> str | None:
        choices = self.constraint(structured).choices
        return (
            None if text in choices else f"{validation.short(text)} is not one of the {len(choices)} choices"
        )

    def validates_cheaply(self, structured: StructuredOutput) -> bool:
        return True

    def instructions(self, structured: StructuredOutput) -> str:
        return "Answer with exactly one of these options, verbatim, and nothing else: " + json.dumps(
            list(self.constraint(structured).choices)
        )

    def tidy_prompted(self, structured: StructuredOutput, text: str) -> str:
        choices = self.constraint(structured).choices
        stripped = text.strip()
        if stripped not in choices:
            unquoted = stripped.strip("\"'`").rstrip(".")
            if unquoted in choices:
                return unquoted
        return stripped

    def as_json_schema(self, structured: StructuredOutput) -> dict[str, Any] | None:
        return {"type": "string", "enum": list(self.constraint(structured).choices)}

    def from_json_answer(self, value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    def from_json_text(self, text: str) -> str:
        try:
            value = json.loads(text)
        except ValueError:
            return text.strip()
        return value if isinstance(value, str) else text.strip()


class GrammarSpec(ConstraintSpec[GrammarConstraint]):
    kind = ConstraintKind.GRAMMAR
    constraint_type = GrammarConstraint
    field = "structured_output.grammar"
    content_field = "structured_output.grammar.definition"
    invalid_reason = "INVALID_GRAMMAR"

    def limit_violations(self, constraint: GrammarConstraint, limits: RequestLimits) -> list[FieldViolation]:
        field, definition = self.content_field, constraint.definition
        size = text_bytes(definition, limits.max_constraint_bytes)
        if size > limits.max_constraint_bytes:
            return [over_constraint_bytes(field, "the grammar's size in bytes", size, limits)]
        body, regexes = grammar_parts(definition, lark=constraint.syntax is GrammarSyntax.LARK)
        for pattern in regexes:
            found = regex_violations(field, pattern, limits, check_bytes=False)
            if found:
                return found
        shape = regex_shape(body, cap=limits.max_regex_expansion + 1)
        if shape.expansion > limits.max_regex_expansion:
            return [
                over_limit(
                    field,
                    "the grammar's size with counted repetitions expanded",
                    shape.expansion,
                    "max_regex_expansion",
                    limits.max_regex_expansion,
                )
            ]
        rules = grammar_rule_count(definition)
        if rules > limits.max_grammar_rules:
            return [
                over_limit(
                    field, "the number of grammar rules", rules, "max_grammar_rules", limits.max_grammar_rules
                )
            ]
        return []

    def weight(self, constraint: GrammarConstraint) -> int:
        body, regexes = grammar_parts(constraint.definition, lark=constraint.syntax is GrammarSyntax.LARK)
        expansion = regex_shape(body, cap=_WEIGHT_CAP).expansion
        return max(1, expansion + sum(regex_shape(r, cap=_WEIGHT_CAP).expansion for r in regexes))

    def check_shape(self, structured: StructuredOutput, caps: ModelCapabilities) -> None:
        c = self.constraint(structured)
        if not c.definition.strip():
            raise errors.InvalidArgument.field(
                self.content_field, "must not be empty", reason="INVALID_GRAMMAR"
            )
        if c.syntax not in caps.grammar_syntaxes:
            served = ", ".join(sorted(s.value for s in caps.grammar_syntaxes)) or "none"
            raise errors.Unimplemented(
                f"grammar syntax {c.syntax.value} is not supported by this model (supported: {served})",
                reason="GRAMMAR_SYNTAX_UNSUPPORTED",
                violations=[FieldViolation(f"{self.field}.syntax", "not supported by this model")],
            )

    def check_syntax(self, structured: StructuredOutput) -> None:
        c = self.constraint(structured)
        self._check(c, self._grammar(c))

    def lower(self, structured: StructuredOutput, *, syntax_checked: bool = False) -> LoweredConstraint:
        c = self.constraint(structured)
        if not c.definition.strip():
            raise errors.InvalidArgument.field(
                self.content_field, "the grammar is empty", reason="INVALID_GRAMMAR"
            )
        grammar = self._grammar(c)
        if not syntax_checked:  # check_syntax checked this very grammar
            self._check(c, grammar)
        return LoweredConstraint(self.kind, grammar)

    def validate(self, structured: StructuredOutput, text: str) -> str | None:
        return validation.validate_grammar(self.constraint(structured), text, field=self.content_field)

    def instructions(self, structured: StructuredOutput) -> str:
        c = self.constraint(structured)
        return (
            f"Answer with only text that is a sentence of this {c.syntax.value.upper()} grammar, nothing "
            f"else:\n{c.definition}"
        )

    def unserved_by(self, structured: StructuredOutput, grammar_syntaxes: frozenset[GrammarSyntax]) -> str:
        syntax = self.constraint(structured).syntax
        return "" if syntax in grammar_syntaxes else f"grammar syntax {syntax.value} is not accepted"

    def _grammar(self, c: GrammarConstraint) -> str:
        """The llguidance grammar of the definition (GBNF and EBNF converted to Lark)."""
        return LLMatcher.grammar_from_lark(
            lowering.grammar_to_lark(c.syntax, c.definition, field=self.content_field)
        )

    def _check(self, c: GrammarConstraint, grammar: str) -> None:
        what = f"invalid {c.syntax.value.upper()} grammar"
        lowering.check_grammar(grammar, self.content_field, "INVALID_GRAMMAR", what=what)


_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


def _unfenced(text: str) -> str:
    """JSON a model wrapped in a Markdown code fence, without it."""
    match = _FENCE.match(text)
    return (match.group(1) if match else text).strip()


SPECS: dict[ConstraintKind, ConstraintSpec[Any]] = {
    spec.kind: spec for spec in (JsonSchemaSpec(), RegexSpec(), ChoiceSpec(), GrammarSpec(), JsonObjectSpec())
}


def spec_of(what: StructuredOutput | Constraint | ConstraintKind) -> ConstraintSpec[Any]:
    """The spec of a structured output's kind, a constraint's, or a kind's."""
    if isinstance(what, ConstraintKind):
        kind = what
    else:
        kind = what.constraint.kind if isinstance(what, StructuredOutput) else what.kind
    spec = SPECS.get(kind)
    if spec is None:
        raise errors.InvalidArgument.field(
            "structured_output", f"unknown constraint {what!r}", reason="UNSUPPORTED"
        )
    return spec


# ---- what other modules call: each asks the kind's spec ------------------------------------


def field_of(kind: ConstraintKind) -> str:
    """The request field (relative to the request) that holds a constraint of this kind."""
    return spec_of(kind).content_field


def constraint_violations(constraint: Constraint, limits: RequestLimits) -> list[FieldViolation]:
    """Size, count, nesting and expansion limits of one constraint (gengate.checks asks)."""
    return spec_of(constraint).limit_violations(constraint, limits)


def cache_fields(constraint: Constraint, *, grammar_only: bool = False) -> dict[str, Any]:
    """A constraint's fields as caches key them (its spec's `cache_fields`)."""
    return spec_of(constraint).cache_fields(constraint, grammar_only=grammar_only)


def constraint_weight(constraint: Constraint) -> int:
    """About the grammar-engine states a compiled constraint holds, for weighing caches of them:
    expanded regex states, a grammar's expanded rules, a schema's size / 64, choice bytes / 8.
    (`a{99999}` holds ~33 MB once compiled and used: a cache must not keep hundreds.)"""
    return spec_of(constraint).weight(constraint)


def check_constraint_syntax(structured: StructuredOutput) -> None:
    """Raises InvalidArgument when the constraint is malformed on its face (in the sandbox)."""
    spec_of(structured).check_syntax(structured)


def lower(structured: StructuredOutput, *, syntax_checked: bool = False) -> LoweredConstraint:
    """Lowers a domain structured-output request to an llguidance grammar, or raises InvalidArgument."""
    return spec_of(structured).lower(structured, syntax_checked=syntax_checked)


def validate_output(structured: StructuredOutput, text: str) -> str | None:
    """None when `text` satisfies the constraint, else a short human-readable reason."""
    return spec_of(structured).validate(structured, text)


def cheap_to_validate(structured: StructuredOutput, text: str) -> bool:
    """True when validating `text` costs microseconds whatever the constraint holds."""
    return len(text) <= validation.CHEAP_TEXT_CHARS and spec_of(structured).validates_cheaply(structured)


def constraint_instructions(structured: StructuredOutput) -> str:
    """A system-prompt paragraph describing the constraint, for providers that do not enforce it."""
    return spec_of(structured).instructions(structured)
