"""The constrained step's fast paths choose exactly what plain masking and sampling choose.

SequenceDecoder applies the mask as bounds (np.minimum with +inf / -inf), counts the allowed
ids instead of listing them, skips the draw's arithmetic for a single allowed id, and reads a
mask of one id (a forced state's) from its bits without building the bounds at all.
PlainMasking below is the decoder's code before those fast paths (penalize a copy, -inf where
the mask disallows, EOS restored when the output is complete, flatnonzero over what is left):
over random masks and logits, NaN and infinities included, both must pick the same tokens, or
fail alike.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from gengate import errors
from gengate.domain import SamplingParams, StoppingCriteria
from gengate.engines.decoding import FloatArray, SequenceDecoder, _cumsum64, _top_p_keep
from gengate.engines.options import EngineOptions
from packed_masks import WithoutPlans, packed_mask_filler


class ScriptedMatcher(WithoutPlans):
    """A matcher that replays (allowed bits, accepting) per step (`at`, set before each step);
    consumes anything. `forced` says every state is forced, which keeps the decoder from drawing
    first: then each step goes through the mask."""

    def __init__(self, vocab_size: int, script: list[tuple[np.ndarray, bool]], *, forced: bool) -> None:
        self.vocab_size = vocab_size
        self._script = script
        self._forced = forced
        self.at = 0
        self.tried = 0  # draws offered to try_advance

    def bind_mask(self, row: np.ndarray) -> Any:
        return packed_mask_filler(row, self.vocab_size, lambda: self._script[self.at][0])

    def is_accepting(self) -> bool:
        return self._script[self.at][1]

    def is_stopped(self) -> bool:
        return False

    def is_forced(self) -> bool:
        return self._forced

    def try_advance(self, token: int) -> int:
        self.tried += 1
        return 0 if self._script[self.at][0][token] else -1

    def advance(self, token: int) -> bool:
        return False


class PlainMasking(SequenceDecoder):
    """The masking and sampling of gengate 8d9dee1, before the constrained fast paths."""

    def _draw_masked(self, raw: FloatArray, matcher: Any) -> int:
        self._fill_mask()
        self._plain_matcher = matcher
        return self._choose(self._masked_exactly(raw))

    def _masked_exactly(self, raw: FloatArray) -> FloatArray:
        matcher = self._plain_matcher
        work = self._scratch()[0][: raw.shape[0]]
        np.copyto(work, raw)
        self._apply_penalties(work)
        eos_values = work[self._eos] if self._eos.size else None
        n = min(matcher.vocab_size, work.shape[0])
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:n].view(np.bool_)
        np.copyto(work[:n], np.float32(-np.inf), where=~allowed)
        work[n:] = -np.inf
        if eos_values is not None:
            work[self._eos] = eos_values if matcher.is_accepting() else -np.inf
        if self._holds_eos():
            work[self._eos] = -np.inf
        return work

    def _choose(self, work: FloatArray, *, constrained: bool = True, normalize: bool = True) -> int:
        if self._greedy:
            token = int(work.argmax())
            if not np.isfinite(work[token]):
                raise self._nothing_allowed()
            return token
        work_buf, probs_buf, cdf_buf = self._scratch()
        if self._temperature != 1.0:
            scaled = probs_buf[: work.shape[0]]
            np.divide(work, np.float32(self._temperature), out=scaled)
        else:
            scaled = work
        ids = None
        cand = scaled
        allowed = np.flatnonzero(scaled > -np.inf)
        if allowed.shape[0] == 0:
            raise self._nothing_allowed()
        if allowed.shape[0] < scaled.shape[0] // 2:
            ids, cand = allowed, scaled[allowed]
        if self._top_k is not None and self._top_k < cand.shape[0]:
            best = np.argpartition(cand, -self._top_k)[-self._top_k :]
            ids = best if ids is None else ids[best]
            cand = cand[best]
        top = float(cand.max())
        if not math.isfinite(top):
            raise self._nothing_allowed()
        probs = probs_buf[: cand.shape[0]]
        np.subtract(cand, top, out=probs)
        np.exp(probs, out=probs)
        probs /= probs.sum()
        if self._top_p is not None:
            keep = _top_p_keep(probs, self._top_p, work_buf, cdf_buf)
            ids = keep if ids is None else ids[keep]
            probs = probs[keep]
        if self._min_p is not None:
            keep = np.flatnonzero(probs >= self._min_p * probs.max())
            ids = keep if ids is None else ids[keep]
            probs = probs[keep]
        cdf = _cumsum64(probs, cdf_buf)
        pick = int(cdf.searchsorted(self._rng.random() * cdf[-1], side="right"))
        pick = min(pick, cdf.shape[0] - 1)
        return int(pick if ids is None else ids[pick])


SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.8 top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "top_k 5 min_p 0.05": {"temperature": 1.3, "top_k": 5, "min_p": 0.05},
    "penalties": {
        "temperature": 0.9,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
    },
}
STEPS = 40


def _script(rng: np.random.Generator, grammar_vocab: int, vocab: int) -> tuple[list[Any], list[np.ndarray]]:
    """Masks of every density (one id, a few, about half, most) and logits for them, some with
    NaN, +inf, -inf and -0.0 where the mask allows or disallows."""
    masks, logits = [], []
    for _ in range(STEPS):
        density = rng.choice([0.0, 0.01, 0.45, 0.5, 0.55, 0.9])
        bits = rng.random(grammar_vocab) < density
        if density == 0.0:
            bits[rng.integers(grammar_vocab)] = True
        masks.append((bits, bool(rng.random() < 0.15)))
        row = (rng.standard_normal(vocab) * 3).astype(np.float32)
        allowed = np.zeros(vocab, dtype=np.bool_)
        allowed[: min(vocab, grammar_vocab)] = bits[:vocab]
        kind = rng.integers(6)
        where = allowed if kind in (1, 2) else ~allowed if kind in (3, 4) else np.zeros(vocab, bool)
        chosen = np.flatnonzero(where & (rng.random(vocab) < 0.05))
        if kind in (1, 3):
            row[chosen] = rng.choice(np.array([np.nan, np.inf, -np.inf, -0.0], dtype=np.float32), chosen.size)
        elif kind in (2, 4):
            row[chosen] = -np.inf  # flips the count of what is left around half the vocabulary
        if kind == 5:
            row[:] = np.where(rng.random(vocab) < 0.3, np.float32(-0.0), row)
        logits.append(row)
    return masks, logits


def _run(
    cls: type[SequenceDecoder], matcher: ScriptedMatcher, logits: list[np.ndarray], **kw: Any
) -> list[Any]:
    decoder = cls(matcher=matcher, **kw)
    out: list[Any] = []
    for at, row in enumerate(logits):
        matcher.at = at
        try:
            result = decoder.step(row)
        except errors.Internal as exc:  # raised before anything changed: the next step goes on
            out.append(exc.reason)
            continue
        out.append(result.token_id)
        if result.finished is not None:
            break
    return out


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize(
    ("grammar_vocab", "vocab", "eos"),
    [(200, 200, {0}), (200, 190, {0, 150}), (200, 256, {0, 230}), (203, 203, set()), (4000, 4000, {3})],
    ids=["same", "model smaller", "model padded", "no eos", "larger"],
)
@pytest.mark.parametrize(
    "options", [EngineOptions(), EngineOptions(min_tokens=5), EngineOptions(ignore_eos=True)], ids=str
)
@pytest.mark.parametrize("forced", [True, False], ids=["masked", "drawn first"])
def test_fast_masking_chooses_what_plain_masking_chooses(
    sampling: str, grammar_vocab: int, vocab: int, eos: set[int], options: EngineOptions, forced: bool
) -> None:
    """Through the mask, every sampling picks as plain masking does; drawn first (unforced
    states), greedy and the cut samplings (which never draw first) do too. Temperature draws
    drawn first spend other random numbers: tests/engines/test_draw_first.py checks their
    distribution instead."""
    if not forced and sampling in ("temperature 1", "penalties"):
        pytest.skip("a temperature draw made first picks by other random numbers (test_draw_first.py)")
    compared = tried = 0
    for seed in range(4):
        rng = np.random.default_rng([seed, grammar_vocab, vocab])
        masks, logits = _script(rng, grammar_vocab, vocab)
        kw: dict[str, Any] = {
            "index": 0,
            "detokenize": lambda ids: b"x",
            "eos_token_ids": frozenset(eos),
            "sampling": SamplingParams(seed=seed, **SAMPLINGS[sampling]),
            "stopping": StoppingCriteria(max_tokens=None),
            "logprobs": None,
            "prompt_token_ids": (1, 2, 3),
            "vocab_size": vocab,
            "options": options,
        }
        matcher = ScriptedMatcher(grammar_vocab, masks, forced=forced)
        fast = _run(SequenceDecoder, matcher, logits, **kw)
        plain = _run(PlainMasking, ScriptedMatcher(grammar_vocab, masks, forced=True), logits, **kw)
        assert fast == plain, (seed, fast, plain)
        compared += len(fast)
        tried += matcher.tried
    assert compared >= 40  # the runs went some way before their ends
    # greedy draws first when unforced; the cut samplings never do
    assert (tried > 0) == (not forced and sampling == "greedy")
