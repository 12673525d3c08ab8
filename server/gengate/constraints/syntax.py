"""Syntax-check helpers: the checks that read a constraint's content, which run in the sandbox.

Each kind's `check_syntax` is its spec's (gengate.constraints.kinds): a JSON Schema against its
metaschema (lowering.check_schema) and its regexes, a regex in the dialect the grammar engine and
validation share (RE2's linear-time matcher where it can read the pattern, else llguidance's), a
grammar by llguidance's own reader. They never run a backtracking matcher.
"""

from __future__ import annotations

from llguidance import LLMatcher

from gengate import errors
from gengate.constraints.regex_dialect import ascii_shorthands
from gengate.constraints.validation import linear_regex_error


def regex_syntax_error(pattern: str) -> str | None:
    """None when the pattern is a regex this server can enforce and validate, else why not."""
    if linear_regex_error(pattern) is None:
        return None
    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_regex(ascii_shorthands(pattern)))
    return errors.brief(error) if error else None


def uses(schema: object, keyword: str) -> bool:
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
