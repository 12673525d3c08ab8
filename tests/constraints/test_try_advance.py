"""ConstraintMatcher.try_advance answers what the mask answers, so a decoder may draw first.

SequenceDecoder draws from all the logits and masks only when the constraint refuses the draw
(engines/decoding.py, `_draw_first`). That is exact only if, in every state that is not forced,
the tokens a consume takes are exactly the mask's. llguidance keeps them equal outside forced
states (where its mask keeps the canonical token only); this walks many constraints, token by
token, and checks every id of the tiny vocabulary against the mask, so an llguidance upgrade
that breaks it fails here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gengate.constraints.compiler import ConstraintCompiler
from gengate.constraints.matcher import ConstraintMatcher
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
from llguidance import LLTokenizer

CORPUS = Path(os.environ.get("GENGATE_SHARED", "/work/shared")) / "corpora" / "jsonschemabench"  # as bench/

CONSTRAINTS: dict[str, Constraint] = {
    "object with bounds": JsonSchemaConstraint(
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 12},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "score": {"type": "number"},
                "kind": {"enum": ["alpha", "beta", None, 3]},
            },
            "required": ["title", "tags", "rating"],
        }
    ),
    "pattern and formats": JsonSchemaConstraint(
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                "when": {"type": "string", "format": "date"},
                "nested": {"type": "array", "items": {"anyOf": [{"type": "boolean"}, {"type": "object"}]}},
            },
            "additionalProperties": False,
        }
    ),
    "json object": JsonObjectConstraint(),
    "regex": RegexConstraint(r"[A-Z][a-z]{2,6} [0-9]{1,3}(\.[0-9])?( (yes|no))*"),
    "choice": ChoiceConstraint(("positive", "negative", "neutral", "pos")),
    "lark": GrammarConstraint(
        GrammarSyntax.LARK,
        'start: item ("," item)*\nitem: WORD | NUMBER\nWORD: /[a-z]+/\nNUMBER: /[0-9]+/',
    ),
    "gbnf": GrammarConstraint(GrammarSyntax.GBNF, 'root ::= "say " ("hi" | "hello") " " [a-z]+'),
    "lark, forcing off": GrammarConstraint(
        GrammarSyntax.LARK, '%llguidance {"no_forcing": true}\nstart: "ab" NUMBER\nNUMBER: /[0-9]{1,3}/'
    ),
}


def _corpus(limit: int) -> dict[str, Constraint]:
    files = sorted(CORPUS.glob("*/*.json"))[:limit]
    return {
        f"corpus {f.parent.name}/{f.stem}": JsonSchemaConstraint(json.loads(f.read_text())) for f in files
    }


def _walk(matcher: ConstraintMatcher, rng: np.random.Generator, steps: int) -> tuple[int, int]:
    """Random walk through the constraint's states; returns (states checked, forced states)."""
    checked = forced = 0
    for _ in range(steps):
        mask = matcher.allowed_token_mask()
        allowed = np.flatnonzero(mask)
        if matcher.is_stopped() or allowed.size == 0:
            break
        if matcher.is_forced():
            forced += 1
        else:
            inner = matcher._matcher
            for token in range(matcher.vocab_size):
                probe = ConstraintMatcher(inner.deep_copy(), matcher.vocab_size)
                answer = probe.try_advance(token)
                taken = answer >= 0
                assert taken == bool(mask[token]), (token, taken, bool(mask[token]))
                if taken:  # "stopped" as advance() tells it
                    assert (answer == 1) == ConstraintMatcher(inner.deep_copy(), matcher.vocab_size).advance(
                        token
                    )
                else:  # a refused try leaves the matcher as it was
                    assert not probe.is_error()
                    assert np.array_equal(probe.allowed_token_mask(), mask)
            checked += 1
        matcher.consume(int(rng.choice(allowed)))
    return checked, forced


CASES = {**CONSTRAINTS, **_corpus(8)}


@pytest.mark.parametrize("name", CASES)
def test_outside_forced_states_a_consume_takes_exactly_the_mask(ll_tokenizer: LLTokenizer, name: str) -> None:
    constraint = CASES[name]
    compiler = ConstraintCompiler(ll_tokenizer, "tiny")
    try:
        compiled = compiler.compile_sync(StructuredOutput(constraint))
    except Exception as exc:  # a corpus schema gengate refuses has no states to walk
        if name in CONSTRAINTS:
            raise
        pytest.skip(f"refused: {exc}")
    checked = 0
    for seed in range(3):
        states, _ = _walk(compiled.new_matcher(), np.random.default_rng(seed), steps=12)
        checked += states
    compiler.close()
    assert checked >= 3


def test_a_forced_state_is_told(ll_tokenizer: LLTokenizer) -> None:
    """After `{` of a fixed-order object the key's bytes are forced: draw-first must mask there."""
    compiler = ConstraintCompiler(ll_tokenizer, "tiny")
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    matcher = compiler.compile_sync(StructuredOutput(JsonSchemaConstraint(schema))).new_matcher()
    assert matcher.is_forced()
    assert matcher.forced_bytes().startswith(b'{"title"')
    compiler.close()
