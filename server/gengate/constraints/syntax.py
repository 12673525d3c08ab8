"""Is a constraint well-formed? The checks that read a constraint's content, run in the sandbox.

A JSON Schema against its metaschema, a regex in the dialect the grammar engine and validation
share (RE2's linear-time matcher where it can read the pattern, else llguidance's), a grammar by
llguidance's own reader. Raises InvalidArgument naming the field; never runs a backtracking matcher.
"""

from __future__ import annotations

import jsonschema
from llguidance import LLMatcher

from gengate import errors
from gengate.constraints.lowering import FIELD_GRAMMAR, FIELD_REGEX, FIELD_SCHEMA, grammar_to_lark
from gengate.constraints.regex_dialect import ascii_shorthands
from gengate.constraints.validation import linear_regex_error
from gengate.domain import GrammarConstraint, JsonSchemaConstraint, RegexConstraint, StructuredOutput


def check_constraint_syntax(structured: StructuredOutput) -> None:
    """Raises InvalidArgument when the constraint is malformed on its face."""
    c = structured.constraint
    if isinstance(c, JsonSchemaConstraint):
        try:
            jsonschema.validators.validator_for(
                c.schema, default=jsonschema.Draft202012Validator
            ).check_schema(c.schema)
        except jsonschema.SchemaError as exc:
            path = "/".join(str(p) for p in exc.path) or "<root>"
            raise errors.InvalidArgument.field(
                FIELD_SCHEMA,
                f"not a valid JSON Schema at {path}: {errors.brief(exc.message)}",
                reason="INVALID_SCHEMA",
            ) from None
        if _uses(c.schema, "unevaluatedProperties") and _uses(c.schema, "patternProperties"):
            # jsonschema finds the properties patternProperties evaluated with Python's backtracking
            # `re`, which this server runs on no caller pattern.
            raise errors.InvalidArgument.field(
                FIELD_SCHEMA,
                "unevaluatedProperties together with patternProperties is not supported",
                reason="UNSUPPORTED_SCHEMA",
            )
        for where, pattern in _patterns(c.schema):
            problem = linear_regex_error(pattern)
            if problem is not None:
                raise errors.InvalidArgument.field(
                    f"{FIELD_SCHEMA}{where}",
                    f"invalid or unsupported regex: {problem}",
                    reason="INVALID_SCHEMA",
                )
    elif isinstance(c, RegexConstraint):
        problem = regex_syntax_error(c.pattern)
        if problem is not None:
            raise errors.InvalidArgument.field(
                FIELD_REGEX, f"invalid regular expression: {problem}", reason="INVALID_REGEX"
            )
    elif isinstance(c, GrammarConstraint):
        grammar = LLMatcher.grammar_from_lark(grammar_to_lark(c.syntax, c.definition))
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise errors.InvalidArgument.field(
                FIELD_GRAMMAR,
                f"invalid {c.syntax.value.upper()} grammar: {errors.brief(error)}",
                reason="INVALID_GRAMMAR",
            )


def regex_syntax_error(pattern: str) -> str | None:
    """None when the pattern is a regex this server can enforce and validate, else why not."""
    if linear_regex_error(pattern) is None:
        return None
    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_regex(ascii_shorthands(pattern)))
    return errors.brief(error) if error else None


def _patterns(schema: object) -> list[tuple[str, str]]:
    from gengate.limits import schema_patterns

    return list(schema_patterns(schema))


def _uses(schema: object, keyword: str) -> bool:
    """True when `keyword` is a key anywhere in the schema (a superset of its keyword uses)."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if keyword in node:
                return True
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return False
