"""Jump-forward decoding gives the tokens of stepping every token.

SequenceDecoder.step_forced takes a token the constraint forces without the model's logits, so an
engine runs the model once for a sampled token and the forced ones after it (llama.cpp does). These
tests generate under many constraints and samplings twice from the same logits (a function of the
tokens so far): once calling step() at every token, once calling step_forced() after each step
until it declines. The two must agree token for token, in text, finish reason and stop; the second
must ask for logits fewer times where the constraint forces tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from gengate.constraints.compiler import CompiledConstraint, ConstraintCompiler
from gengate.domain import (
    ChoiceConstraint,
    Constraint,
    FinishReason,
    GrammarConstraint,
    GrammarSyntax,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
)
from gengate.engines.decoding import SequenceDecoder
from gengate.engines.options import EngineOptions
from llguidance import LLTokenizer

pytestmark = pytest.mark.timeout(300)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}
CONSTRAINTS: dict[str, Constraint] = {
    "json schema": JsonSchemaConstraint(SCHEMA),
    "regex": RegexConstraint(r"id-[0-9]{2,4}: (yes|no), value=[a-z]{1,5}!"),
    "choice": ChoiceConstraint(("positive outlook", "negative outlook", "neutral")),
    "lark": GrammarConstraint(GrammarSyntax.LARK, 'start: "let " NAME " = " NUMBER ";"\nNAME: /[a-z]+/\n'
                              "NUMBER: /[0-9]+/"),
    # forced from the first token to the last: no logits needed at all
    "all forced": JsonSchemaConstraint({"const": {"answer": "forty-two", "sure": True}}),
    # a run long enough to be planned (ConstraintMatcher.plan_forced_run)
    "long literal": JsonSchemaConstraint({"type": "object", "properties": {"note": {"const": "abc " * 90}},
                                          "required": ["note"]}),
    # complete after "ab", and after each optional part: EOS beside the next token
    "optional tails": RegexConstraint(r"ab(cdefgh)?(ijklmn)?"),
    # forced bytes whose mask allows more than the canonical token: step_forced must decline
    "no forcing": GrammarConstraint(GrammarSyntax.LARK, '%llguidance {"no_forcing": true}\n'
                                    'start: "hello world, " /[a-z]+/'),
}  # fmt: skip
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7 top_p 0.9": {"temperature": 0.7, "top_p": 0.9},  # masks first: no draw first
    "top_k 4": {"temperature": 1.2, "top_k": 4},
    "min_p 0.2": {"temperature": 1.0, "min_p": 0.2},
    "penalties": {"temperature": 0.9, "repetition_penalty": 1.3, "frequency_penalty": 0.4},
}


@dataclass
class Run:
    tokens: list[int]
    text: str
    finished: FinishReason | None
    stop: str | None
    logits_asked: int
    masks: int


class HistoryLogits:
    """Seeded logits that depend only on the tokens so far: both runs see the same at each position."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.seed = seed
        self.asked = 0

    def __call__(self, tokens: list[int]) -> np.ndarray:
        self.asked += 1
        digest = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=8).digest()
        rng = np.random.default_rng([self.seed, int.from_bytes(digest, "little")])
        return (rng.standard_normal(self.vocab) * 3).astype(np.float32)


class CountedMasks:
    """Counts the masks a decoder has its matcher compute."""

    def __init__(self) -> None:
        self.count = 0

    def wrap(self, matcher: Any) -> Any:
        bind = matcher.bind_mask

        def counting_bind(row: np.ndarray) -> Any:
            fill = bind(row)

            def counted() -> None:
                self.count += 1
                fill()

            return counted

        matcher.bind_mask = counting_bind
        return matcher


def _decoder(
    compiled: CompiledConstraint, ll: LLTokenizer, sampling: dict[str, Any], seed: int, **kw: Any
) -> tuple[SequenceDecoder, CountedMasks]:
    masks = CountedMasks()
    return SequenceDecoder(
        index=0,
        detokenize=ll.decode_bytes,
        eos_token_ids=frozenset({ll.eos_token}),
        sampling=SamplingParams(seed=seed, **sampling),
        stopping=kw.pop("stopping", StoppingCriteria(max_tokens=120)),
        logprobs=None,
        matcher=masks.wrap(compiled.new_matcher()),
        prompt_token_ids=(1, 2, 3),
        vocab_size=kw.pop("vocab", ll.vocab_size),
        options=kw.pop("options", EngineOptions()),
    ), masks


def _generate(made: tuple[SequenceDecoder, CountedMasks], logits: HistoryLogits, *, jump: bool) -> Run:
    decoder, masks = made
    tokens: list[int] = []
    text = ""
    # with jumps, after every step (and before the first: an engine prefills those) the forced tokens
    forced = decoder.step_forced() if jump else None
    while forced is not None or decoder.finished is None:
        step = forced if forced is not None else decoder.step(logits(tokens))
        if step.token_id is not None:
            tokens.append(step.token_id)
        text += step.text_delta
        forced = decoder.step_forced() if jump and step.finished is None else None
    return Run(tokens, text, decoder.finished, decoder.matched_stop, logits.asked, masks.count)


@pytest.fixture(scope="module")
def compiled(ll_tokenizer: LLTokenizer) -> Iterator[dict[str, CompiledConstraint]]:
    compiler = ConstraintCompiler(ll_tokenizer, "tiny")
    yield {name: compiler.compile_sync(StructuredOutput(c)) for name, c in CONSTRAINTS.items()}
    compiler.close()


def _both(
    compiled: CompiledConstraint, ll: LLTokenizer, sampling: dict[str, Any], seed: int, **kw: Any
) -> tuple[Run, Run]:
    vocab = kw.get("vocab", ll.vocab_size)
    every = _generate(
        _decoder(compiled, ll, sampling, seed, **dict(kw)), HistoryLogits(vocab, seed), jump=False
    )
    jumped = _generate(
        _decoder(compiled, ll, sampling, seed, **dict(kw)), HistoryLogits(vocab, seed), jump=True
    )
    return every, jumped


def _alike(
    compiled: CompiledConstraint, ll: LLTokenizer, sampling: dict[str, Any], seed: int, **kw: Any
) -> tuple[Run, Run]:
    """_both, held to the same tokens, text, end and stop."""
    every, jumped = _both(compiled, ll, sampling, seed, **kw)
    assert (jumped.tokens, jumped.text, jumped.finished, jumped.stop) == (
        every.tokens, every.text, every.finished, every.stop
    ), (seed, ll.decode_bytes(every.tokens))  # fmt: skip
    return every, jumped


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_jumping_forward_gives_the_tokens_of_every_step(
    compiled: dict[str, CompiledConstraint], ll_tokenizer: LLTokenizer, kind: str, sampling: str
) -> None:
    skipped = 0
    for seed in range(3):
        every, jumped = _alike(compiled[kind], ll_tokenizer, SAMPLINGS[sampling], seed)
        assert every.logits_asked == len(every.tokens)
        assert jumped.masks <= every.masks  # a mask step_forced computed but could not use is not redone
        skipped += every.logits_asked - jumped.logits_asked
        if kind == "json schema" and jumped.finished == FinishReason.STOP:
            assert set(json.loads(jumped.text)) == set(SCHEMA["required"])
    if kind != "no forcing":  # (there a forced state's mask allows more than its canonical token)
        assert skipped >= 3, "forced tokens were taken without logits"


def test_planned_runs_are_taken_without_logits(
    compiled: dict[str, CompiledConstraint], ll_tokenizer: LLTokenizer
) -> None:
    _, jumped = _alike(compiled["long literal"], ll_tokenizer, SAMPLINGS["temperature 1"], 5)
    assert "abc abc" in jumped.text
    assert jumped.logits_asked < len(jumped.tokens) // 4, (jumped.logits_asked, len(jumped.tokens))


@pytest.mark.parametrize(
    "stopping",
    [
        StoppingCriteria(max_tokens=7),  # LENGTH inside a forced run
        StoppingCriteria(max_tokens=120, stop=('"age"',)),  # a stop string spelled by forced tokens
        StoppingCriteria(max_tokens=120, stop=("ta",)),
    ],
)
def test_ends_inside_forced_runs_are_the_same(
    compiled: dict[str, CompiledConstraint], ll_tokenizer: LLTokenizer, stopping: StoppingCriteria
) -> None:
    for seed in range(3):
        _, jumped = _alike(
            compiled["json schema"], ll_tokenizer, SAMPLINGS["temperature 1"], seed, stopping=stopping
        )
        assert jumped.finished in (FinishReason.LENGTH, FinishReason.STOP_SEQUENCE)


@pytest.mark.parametrize("kind", ["choice", "optional tails", "json schema"])
def test_held_eos_and_min_tokens_are_the_same(
    compiled: dict[str, CompiledConstraint], ll_tokenizer: LLTokenizer, kind: str
) -> None:
    """EOS allowed beside the next token (an optional tail), held back by min_tokens or ignore_eos."""
    texts: dict[EngineOptions, list[str]] = {}
    for options in (EngineOptions(), EngineOptions(min_tokens=6), EngineOptions(ignore_eos=True)):
        for seed in range(6):
            _, jumped = _alike(
                compiled[kind],
                ll_tokenizer,
                SAMPLINGS["temperature 1"],
                seed,
                options=options,
                stopping=StoppingCriteria(max_tokens=40),
            )
            texts.setdefault(options, []).append(jumped.text)
    if kind == "optional tails":
        assert "ab" in texts[EngineOptions()]  # EOS taken where it stood beside the next token
        assert all(t.endswith("ijklmn") for t in texts[EngineOptions(ignore_eos=True)])  # never taken


def test_a_padded_vocabulary_is_the_same(
    compiled: dict[str, CompiledConstraint], ll_tokenizer: LLTokenizer
) -> None:
    """Model logits longer than the grammar's vocabulary: ids past it are never allowed."""
    for kind in ("json schema", "regex"):
        for seed in range(3):
            every, jumped = _alike(
                compiled[kind],
                ll_tokenizer,
                SAMPLINGS["temperature 1"],
                seed,
                vocab=ll_tokenizer.vocab_size + 37,
            )
            assert max(jumped.tokens) < ll_tokenizer.vocab_size
            assert jumped.logits_asked < every.logits_asked


def test_no_jump_without_a_constraint_or_with_logprobs(
    compiled: dict[str, CompiledConstraint], ll_tokenizer: LLTokenizer
) -> None:
    plain = SequenceDecoder(
        index=0, detokenize=ll_tokenizer.decode_bytes, eos_token_ids=frozenset({ll_tokenizer.eos_token}),
        sampling=SamplingParams(seed=1), stopping=StoppingCriteria(max_tokens=5), logprobs=None,
        matcher=None, prompt_token_ids=(1,), vocab_size=ll_tokenizer.vocab_size,
    )  # fmt: skip
    plain.step(HistoryLogits(ll_tokenizer.vocab_size, 1)([]))
    assert plain.step_forced() is None
    with_logprobs = SequenceDecoder(
        index=0, detokenize=ll_tokenizer.decode_bytes, eos_token_ids=frozenset({ll_tokenizer.eos_token}),
        sampling=SamplingParams(seed=1), stopping=StoppingCriteria(max_tokens=50), logprobs=2,
        matcher=compiled["json schema"].new_matcher(), prompt_token_ids=(1,),
        vocab_size=ll_tokenizer.vocab_size,
    )  # fmt: skip
    logits = HistoryLogits(ll_tokenizer.vocab_size, 1)
    tokens: list[int] = []
    while with_logprobs.finished is None:
        step = with_logprobs.step(logits(tokens))
        assert step.logprob is not None
        if step.token_id is not None:
            tokens.append(step.token_id)
        assert with_logprobs.step_forced() is None  # each token's logprob needs its logits
    assert logits.asked >= len(tokens)
