"""A constrained step that draws before it masks gives the masked distribution (exactly, up to
float32 rounding of the probabilities).

SequenceDecoder draws from all the logits first and keeps the draw when the constraint allows it,
masking (and drawing again) only when not. A token t of the allowed set A then comes out with
p(t) + (1 - p(A)) * p(t) / p(A) = p(t) / p(A): what masking first gives. These tests count many
seeded single steps of one state and hold each token's share to p(t) / p(A) within 5 standard
errors (the seeds are fixed, so the outcome is too), for temperatures, penalties and a held EOS.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from gengate.domain import SamplingParams, StoppingCriteria
from gengate.engines.decoding import SequenceDecoder
from gengate.engines.options import EngineOptions
from packed_masks import WithoutPlans, packed_mask_filler

VOCAB = 12
EOS = 0
ALLOWED = np.zeros(VOCAB, dtype=np.bool_)
ALLOWED[[EOS, 2, 3, 5, 8, 9]] = True
DRAWS = 6_000


class OneState(WithoutPlans):
    """A constraint stuck in one state: `allowed` ids, complete (EOS allowed) when `accepting`."""

    def __init__(self, *, forced: bool, accepting: bool = True) -> None:
        self.vocab_size = VOCAB
        self._forced = forced
        self._accepting = accepting
        self.tried = self.taken = 0

    def bind_mask(self, row: np.ndarray) -> Any:
        return packed_mask_filler(row, VOCAB, lambda: ALLOWED)

    def is_accepting(self) -> bool:
        return self._accepting

    def is_stopped(self) -> bool:
        return False

    def is_forced(self) -> bool:
        return self._forced

    def try_advance(self, token: int) -> int:
        self.tried += 1
        self.taken += bool(ALLOWED[token])
        return 0 if ALLOWED[token] else -1

    def advance(self, token: int) -> bool:
        assert ALLOWED[token], token
        return False


def _decoder(
    matcher: OneState, seed: int, sampling: dict[str, Any], options: EngineOptions
) -> SequenceDecoder:
    return SequenceDecoder(
        index=0,
        detokenize=lambda ids: b"x",
        eos_token_ids=frozenset({EOS}),
        sampling=SamplingParams(seed=seed, **sampling),
        stopping=StoppingCriteria(max_tokens=None),
        logprobs=None,
        matcher=matcher,  # type: ignore[arg-type]
        prompt_token_ids=(2, 8, 11),
        vocab_size=VOCAB,
        options=options,
    )


def _expected(logits: np.ndarray, sampling: dict[str, Any], allowed: np.ndarray) -> np.ndarray:
    work = logits.astype(np.float64)
    penalty = sampling.get("repetition_penalty")
    if penalty:
        seen = [2, 8, 11]
        work[seen] = np.where(work[seen] > 0, work[seen] / penalty, work[seen] * penalty)
    work = work / sampling["temperature"]
    p = np.exp(work - work.max()) * allowed
    return p / p.sum()


SAMPLINGS = {
    "temperature 1": {"temperature": 1.0},
    "temperature 0.6": {"temperature": 0.6},
    "repetition penalty": {"temperature": 1.2, "repetition_penalty": 1.5},
}


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("held_eos", [False, True], ids=["eos allowed", "eos held"])
def test_drawn_first_tokens_follow_the_masked_distribution(sampling: str, held_eos: bool) -> None:
    logits = (np.random.default_rng(7).standard_normal(VOCAB) * 1.5).astype(np.float32)
    logits[EOS] = 1.0  # EOS likely enough to be drawn often
    logits[[2, 8]] = (2.0, 1.5)  # allowed, in the prompt, and likely: the penalty moves them much
    options = EngineOptions(min_tokens=1) if held_eos else EngineOptions()
    allowed = ALLOWED.copy()
    if held_eos:
        allowed[EOS] = False
    expected = _expected(logits, SAMPLINGS[sampling], allowed)
    for forced in (False, True):  # drawn first, and masked first: both the same distribution
        matcher = OneState(forced=forced)
        counts = np.zeros(VOCAB, dtype=np.int64)
        for seed in range(DRAWS):
            counts[_decoder(matcher, seed, SAMPLINGS[sampling], options).step(logits).token_id] += 1
        assert counts[~allowed].sum() == 0
        for token in np.flatnonzero(allowed):
            q = expected[token]
            slack = 5 * math.sqrt(DRAWS * q * (1 - q)) + 1
            assert abs(counts[token] - DRAWS * q) <= slack, (forced, token, counts[token], DRAWS * q)
        if forced:
            assert matcher.tried == 0
        else:  # both ways were taken: draws kept, and draws refused then masked
            assert 0 < matcher.taken < matcher.tried <= DRAWS


def test_a_drawn_eos_is_kept_only_when_the_output_is_complete() -> None:
    logits = np.full(VOCAB, -5.0, dtype=np.float32)
    logits[EOS] = 10.0  # nearly every draw is EOS
    for accepting in (True, False):
        matcher = OneState(forced=False, accepting=accepting)
        masked = {
            _decoder(OneState(forced=True, accepting=accepting), seed, {"temperature": 1.0}, EngineOptions())
            .step(logits)
            .token_id
            for seed in range(50)
        }
        tokens = {
            _decoder(matcher, seed, {"temperature": 1.0}, EngineOptions()).step(logits).token_id
            for seed in range(50)
        }
        assert (EOS in tokens) == accepting
        assert (EOS in masked) == accepting
        # a drawn EOS is kept without the mask when complete (no try), refused when not
        assert matcher.tried < 50 if accepting else matcher.tried == 0
        assert tokens <= set(np.flatnonzero(ALLOWED if accepting else ALLOWED & (np.arange(VOCAB) != EOS)))


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize(
    "sampling", [{"temperature": 1.0}, {"temperature": 0.0}], ids=["temperature 1", "greedy"]
)
def test_logits_the_draw_cannot_take_go_through_the_mask_unchanged(
    bad: float, sampling: dict[str, Any]
) -> None:
    """NaN or +inf where the constraint disallows: the draw gives up before spending a random
    number, so the masked path picks what it picks when masking first."""
    rng = np.random.default_rng(3)
    for seed in range(200):
        logits = rng.standard_normal(VOCAB).astype(np.float32)
        logits[rng.choice(np.flatnonzero(~ALLOWED))] = bad
        first = _decoder(OneState(forced=False), seed, sampling, EngineOptions()).step(logits).token_id
        masked = _decoder(OneState(forced=True), seed, sampling, EngineOptions()).step(logits).token_id
        assert first == masked
        assert ALLOWED[first]


def test_cut_samplings_never_draw_first() -> None:
    """top-k / top-p / min-p cut the distribution before a draw: drawing first would cut it
    before the mask instead of after, so those always mask first."""
    logits = np.random.default_rng(5).standard_normal(VOCAB).astype(np.float32)
    for cut in ({"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.2}):
        matcher = OneState(forced=False)
        for seed in range(20):
            token = (
                _decoder(matcher, seed, {"temperature": 1.0, **cut}, EngineOptions()).step(logits).token_id
            )
            assert ALLOWED[token]
        assert matcher.tried == 0, cut
