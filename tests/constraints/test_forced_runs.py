"""A long forced run is tokenized once, where it starts, not at each of its tokens.

In a forced state llguidance's mask tokenizes every forced byte that remains to find the
canonical next token, so a long literal cost its length at each of its tokens (~20 ms a token
at 100 KB on tiny: a literal of `max_constraint_bytes` made one request hold its engine for
minutes). ConstraintMatcher.plan_forced_run takes the run's tokens once; the decoder then takes
them one by one (engines/decoding.py, `_take_planned`). These tests hold the planned tokens to
the tokens of masking every step where the two tokenize alike, their bytes to its bytes where
they do not, on both tokenizers the engines use; the model keeps its choice where what follows
may join the run's end; and the masks stop growing with the run's length.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gengate.constraints import matcher as matcher_module
from gengate.constraints.compiler import CompiledConstraint, ConstraintCompiler
from gengate.constraints.matcher import PLAN_BYTES, ConstraintMatcher
from gengate.domain import (
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    GrammarSyntax,
    JsonSchemaConstraint,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
)
from gengate.engines.decoding import SequenceDecoder
from gengate.models.tiny import TinyModelPaths
from llguidance import LLTokenizer

pytestmark = pytest.mark.timeout(300)

TEXTS = {
    "letters": "abcdefghij" * 60,
    "words": "The quick brown fox jumps over the lazy dog. " * 15,
    "unicode": "héllo wörld ✓ 日本語 " * 25,
    "digits and spaces": "1234 5678  90 " * 40,
}


def _constraints(text: str) -> dict[str, Constraint]:
    return {
        "json const": JsonSchemaConstraint({"type": "object", "properties": {"note": {"const": text}},
                                            "required": ["note"]}),
        "lark literal": GrammarConstraint(GrammarSyntax.LARK, f"start: {json.dumps(text)} /[0-9]/"),
        "choice of one": ChoiceConstraint((text,)),
    }  # fmt: skip


CASES = [(t, c) for t in TEXTS for c in _constraints("x")]
SAMPLINGS = {"greedy": {"temperature": 0.0}, "temperature 1": {"temperature": 1.0}}


@pytest.fixture(scope="module", params=["hf", "llama"])
def tokenizer(
    request: pytest.FixtureRequest, tiny_model: TinyModelPaths, ll_tokenizer: LLTokenizer
) -> Iterator[Any]:
    """(LLTokenizer, vocab size, EOS id) of the tiny model, as transformers' and llama.cpp's
    engines make it."""
    if request.param == "hf":
        yield ll_tokenizer, ll_tokenizer.vocab_size, ll_tokenizer.eos_token
        return
    llama_cpp = pytest.importorskip("llama_cpp")
    from gengate.constraints import make_ll_tokenizer_from_llama

    llm = llama_cpp.Llama(str(tiny_model.gguf_path), n_ctx=64, verbose=False)
    try:
        ll = make_ll_tokenizer_from_llama(llm)
        yield ll, llm.n_vocab(), llm.token_eos()
    finally:
        llm.close()


def _generate(
    compiled: CompiledConstraint, vocab: int, eos: int, seed: int, sampling: str
) -> tuple[list[int], int]:
    """A generation under the constraint from seeded random logits: (its tokens, masks computed)."""
    matcher = compiled.new_matcher()
    masks = 0
    bind = matcher.bind_mask

    def counting_bind(row: np.ndarray) -> Any:
        fill = bind(row)

        def counted() -> None:
            nonlocal masks
            masks += 1
            fill()

        return counted

    matcher.bind_mask = counting_bind  # type: ignore[method-assign]
    decoder = SequenceDecoder(
        index=0,
        detokenize=lambda ids: b"",
        eos_token_ids=frozenset({eos}),
        sampling=SamplingParams(seed=seed, **SAMPLINGS[sampling]),
        stopping=StoppingCriteria(max_tokens=2000),
        logprobs=None,
        matcher=matcher,
        prompt_token_ids=(1,),
        vocab_size=vocab,
    )
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    while decoder.finished is None:
        step = decoder.step(rng.standard_normal(vocab).astype(np.float32) * 3)
        if step.token_id is not None:
            tokens.append(step.token_id)
    return tokens, masks


def _planned_and_masked(
    compiled: CompiledConstraint, vocab: int, eos: int, seed: int, sampling: str, patch: pytest.MonkeyPatch
) -> tuple[tuple[list[int], int], tuple[list[int], int]]:
    """The same generation with plans, and with a mask every step."""
    planned = _generate(compiled, vocab, eos, seed, sampling)
    with patch.context() as never:
        never.setattr(matcher_module, "PLAN_BYTES", 1 << 40)
        masked = _generate(compiled, vocab, eos, seed, sampling)
    return planned, masked


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize(("text", "kind"), CASES)
def test_a_planned_run_gives_the_tokens_of_masking_every_step(
    tokenizer: Any, text: str, kind: str, sampling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ll, vocab, eos = tokenizer
    compiler = ConstraintCompiler(ll, "tiny")
    compiled = compiler.compile_sync(StructuredOutput(_constraints(TEXTS[text])[kind]))
    for seed in range(2):
        (planned, planned_masks), (masked, every_step) = _planned_and_masked(
            compiled, vocab, eos, seed, sampling, monkeypatch
        )
        assert planned == masked, (seed, kind)
        out = ll.decode_bytes(planned)
        if kind == "json const":
            assert json.loads(out)["note"] == TEXTS[text]
        else:
            assert out.startswith(TEXTS[text].encode())
        assert every_step >= 60
        assert planned_masks <= every_step // 4, (planned_masks, every_step)
    compiler.close()


def test_masks_in_a_planned_run_do_not_grow_with_its_length(tokenizer: Any) -> None:
    ll, vocab, eos = tokenizer
    compiler = ConstraintCompiler(ll, "tiny")
    masks = []
    for repeat in (30, 300):
        constraint = ChoiceConstraint(("abcdefghij" * repeat,))
        tokens, count = _generate(
            compiler.compile_sync(StructuredOutput(constraint)), vocab, eos, 1, "greedy"
        )
        assert len(tokens) >= repeat
        masks.append(count)
    compiler.close()
    assert masks[1] <= masks[0] + 2, masks  # ten times the run, not ten times the masks


def test_a_token_other_than_the_planned_one_ends_the_plan(tokenizer: Any) -> None:
    ll, _, _ = tokenizer
    compiler = ConstraintCompiler(ll, "tiny")
    compiled = compiler.compile_sync(StructuredOutput(ChoiceConstraint((TEXTS["words"],))))
    matcher = compiled.new_matcher()
    only = int(np.flatnonzero(matcher.allowed_token_mask())[0])
    assert matcher.is_forced()
    matcher.plan_forced_run(only)
    assert matcher.plan[-1] == only
    matcher.advance(only)
    assert matcher.plan  # the plan goes on with its own tokens
    following = matcher.plan[-1]
    # another token the forced bytes also spell (not the canonical one), taken by a consume
    rest = matcher.forced_bytes()
    spelling = [(t, ll.decode_bytes([t])) for t in range(ll.vocab_size) if t != following]
    other = next(t for t, piece in spelling if piece and rest.startswith(piece))
    assert matcher.try_advance(other) >= 0
    assert not matcher.plan
    compiler.close()


def test_a_short_run_and_a_no_forcing_grammar_make_no_plan(tokenizer: Any) -> None:
    ll, _, _ = tokenizer
    compiler = ConstraintCompiler(ll, "tiny")
    short = "abcdefghij" * (PLAN_BYTES // 20)
    literal = json.dumps("abcdefghij" * 60)
    no_forcing = '%llguidance {"no_forcing": true}\nstart: ' + literal
    escaped = '%llguidance {"no\\u005fforcing": true}\nstart: ' + literal  # the same option, escaped
    grammars = [GrammarConstraint(GrammarSyntax.LARK, g) for g in (no_forcing, escaped)]
    for constraint in (ChoiceConstraint((short,)), *grammars):
        matcher: ConstraintMatcher = compiler.compile_sync(StructuredOutput(constraint)).new_matcher()
        allowed = np.flatnonzero(matcher.allowed_token_mask())
        matcher.is_forced()
        matcher.plan_forced_run(int(allowed[0]))
        assert not matcher.plan, constraint
    compiler.close()


def test_where_what_follows_may_join_the_run_masks_take_over(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Letters after a run that ends in letters: near its end a mask allows more than one token
    (`l` or `ld` before `lld` + a letter), so the plan stops short of the end and the model
    chooses there as it would with a mask every step."""
    ll, vocab, eos = tokenizer
    compiler = ConstraintCompiler(ll, "tiny")
    run = "<" + "abcdefghij" * 30 + " vee'lld"
    compiled = compiler.compile_sync(
        StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, f'start: {json.dumps(run)} /[a-z]+/ "."'))
    )
    for seed in range(12):
        (planned, planned_masks), (masked, every_step) = _planned_and_masked(
            compiled, vocab, eos, seed, "temperature 1", monkeypatch
        )
        assert planned == masked, seed
        # masks counted, not timed (seeded: the same every run): most of the run's ~300 tokens took none
        assert every_step - planned_masks >= 200
    compiler.close()


def test_a_run_split_otherwise_by_masks_spells_the_same_bytes(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Masks re-tokenize from the last token on, which splits `'sir` after `}{` otherwise than the
    whole run's tokenization the plan holds: other tokens, the same bytes."""
    ll, vocab, eos = tokenizer
    compiler = ConstraintCompiler(ll, "tiny")
    run = "}{'sir " * 50
    compiled = compiler.compile_sync(StructuredOutput(ChoiceConstraint((run,))))
    (planned, _), (masked, _) = _planned_and_masked(compiled, vocab, eos, 0, "greedy", monkeypatch)
    assert ll.decode_bytes(planned) == ll.decode_bytes(masked) == run.encode()
    compiler.close()
