"""SequenceDecoder: the per-token logic every local engine shares, so they all behave alike.

Given the model's next-token logits, a decoder applies penalties, the constraint mask,
temperature / top-k / top-p / min-p, samples with its own seeded generator, detokenizes
incrementally (UTF-8 safe), holds back text that may begin a stop string, and decides when the
generation ends. Engines only run the model and feed logits. LoopHandoff carries what the
model thread produced to the event loop with few wake-ups.

Semantics (documented, shared by all engines):
- temperature None means 1.0; 0 means greedy (argmax).
- repetition_penalty (HF/vLLM style: divide positive logits, multiply negative ones) applies to
  tokens of the prompt and the output; frequency_penalty (x count) and presence_penalty (once)
  apply to output tokens only, as in OpenAI and vLLM.
- logprobs are the log-softmax of the model's raw logits (before penalties, temperature and the
  constraint mask), as OpenAI reports them; `logprobs=k` adds the k most likely alternatives.
- the random generator of generation `index` is PCG64 seeded with (seed, index), so generations
  of one request differ and a seeded request is reproducible on every engine.
- EOS ends the generation with STOP (counted in output tokens, never in the text); a stop string
  ends it with STOP_SEQUENCE and is cut from the text; a constraint that can take nothing more
  ends it with STOP; max_tokens ends it with LENGTH.
- backend option min_tokens masks EOS until that many tokens are out, and only text after them
  can match a stop string (vLLM's semantics); ignore_eos masks EOS throughout (engines/options.py).
"""

from __future__ import annotations

import asyncio
import codecs
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from gengate import errors
from gengate.constraints.matcher import ConstraintMatcher
from gengate.domain import FinishReason, SamplingParams, StoppingCriteria, TokenLogprob, TopLogprob
from gengate.engines.options import NO_OPTIONS, EngineOptions

FloatArray = npt.NDArray[np.float32]
T = TypeVar("T")
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class StepResult:
    """What one step produced. `token_id` is None only when the step ended without sampling."""

    token_id: int | None
    text_delta: str
    finished: FinishReason | None = None
    matched_stop: str | None = None
    logprob: TokenLogprob | None = None


class SequenceDecoder:
    """Chooses tokens and builds the text of one generation; one instance per generation."""

    def __init__(
        self,
        *,
        index: int,
        detokenize: Callable[[list[int]], bytes | str],
        eos_token_ids: frozenset[int],
        sampling: SamplingParams,
        stopping: StoppingCriteria,
        logprobs: int | None,
        matcher: ConstraintMatcher | None,
        prompt_token_ids: Sequence[int],
        vocab_size: int,
        options: EngineOptions = NO_OPTIONS,
    ) -> None:
        self.index = index
        self._detokenize = detokenize
        self._eos = np.array(sorted(t for t in eos_token_ids if 0 <= t < vocab_size), dtype=np.int64)
        self._eos_set = frozenset(eos_token_ids)
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._logprobs = logprobs
        self._max_tokens = stopping.max_tokens
        self._stops = tuple(s for s in stopping.stop if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        # No end before min_tokens (EOS masked, stop strings not looked for), none by EOS at all
        # with ignore_eos: vLLM's semantics for its options of the same names.
        self._min_tokens = options.min_tokens
        self._ignore_eos = options.ignore_eos
        self._stops_from = 0  # stop strings are looked for from here in _full

        temperature = 1.0 if sampling.temperature is None else float(sampling.temperature)
        self._greedy = temperature <= 0.0
        self._temperature = temperature
        self._top_k = sampling.top_k if sampling.top_k and sampling.top_k > 0 else None
        self._top_p = sampling.top_p if sampling.top_p is not None and 0.0 < sampling.top_p < 1.0 else None
        self._min_p = sampling.min_p if sampling.min_p and sampling.min_p > 0.0 else None
        self._repetition = sampling.repetition_penalty
        if self._repetition is not None and (self._repetition <= 0.0 or self._repetition == 1.0):
            self._repetition = None
        self._frequency = sampling.frequency_penalty or 0.0
        self._presence = sampling.presence_penalty or 0.0
        seed = 0 if sampling.seed is None else sampling.seed
        self._rng = np.random.Generator(np.random.PCG64([seed & _MASK64, index]))

        self._penalized = self._repetition is not None or bool(self._frequency or self._presence)
        # token history for the penalties, kept only when one is set
        self._seen: set[int] = set()
        if self._repetition is not None:
            self._seen = {t for t in prompt_token_ids if 0 <= t < vocab_size}
        self._seen_ids: npt.NDArray[np.int64] | None = None
        self._counts: dict[int, int] = {}
        if matcher is not None:
            words = (matcher.vocab_size + 31) // 32
            self._bitmask = np.zeros(words, dtype=np.int32)
            self._fill_mask = matcher.bind_mask(self._bitmask)
            self._mask_bytes = self._bitmask.view(np.uint8)
            # The mask as bounds on the logits: +inf where allowed, -inf elsewhere; the bits are
            # read a byte at a time through _BYTE_MASKS into its rows. Ids past the grammar's
            # vocabulary (a padded model vocabulary) are never allowed.
            self._mask = np.full(max(vocab_size, 32 * words), -np.inf, dtype=np.float32)
            self._mask_rows = self._mask[: 32 * words].reshape(-1, 8)
            tail = min(vocab_size, 32 * words)
            self._mask_tail = slice(matcher.vocab_size, tail) if matcher.vocab_size < tail else None
            self._eos_ids = tuple(int(t) for t in self._eos)
            self._allowed = np.empty(vocab_size, dtype=np.bool_)
            self._stop_checked = False  # is_stopped() was False after the last consumed token
        self._mask_ready = False  # the mask holds this state's (step_forced filled it)
        # Draw first and mask only when the draw is refused (_draw_first): exact for temperature
        # and greedy sampling, not under a cut of the distribution (top-k / top-p / min-p).
        self._draws_first = (
            matcher is not None and self._top_k is None and self._top_p is None and self._min_p is None
        )
        # Without penalties or a mask the logits are only read, so step() skips its copy.
        self._edits_logits = matcher is not None or self._penalized or options.holds_eos
        # Scratch buffers reused every step: allocating vocab-sized arrays per token (page
        # faults at 128k) cost more than the arithmetic. Allocated on first use.
        self._buffers: tuple[FloatArray, FloatArray, npt.NDArray[np.float64]] | None = None

        self._tokens: list[int] = []
        self._finished: FinishReason | None = None
        self._matched_stop: str | None = None
        # Detokenization: bytes mode decodes token by token; str mode diffs a sliding window.
        self._mode: str | None = None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text_tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._full = ""  # all decoded text (stop string excluded once matched)
        self._emitted = 0  # how much of _full has been handed out
        self._piece_cache: dict[int, str] = {}

    # -- public state ---------------------------------------------------------------------

    @property
    def text(self) -> str:
        """The text handed out so far (the final text once finished)."""
        return self._full[: self._emitted]

    @property
    def output_token_ids(self) -> list[int]:
        return list(self._tokens)

    @property
    def finished(self) -> FinishReason | None:
        return self._finished

    @property
    def jumps_forward(self) -> bool:
        """Whether step_forced may take tokens: under a constraint, without logprobs."""
        return self._matcher is not None and self._logprobs is None

    @property
    def matched_stop(self) -> str | None:
        return self._matched_stop

    # -- stepping -------------------------------------------------------------------------

    def step(self, logits: npt.NDArray[np.floating]) -> StepResult:
        """Chooses the next token from the model's logits for this sequence and advances."""
        if self._finished is not None:
            raise RuntimeError("step() called on a finished generation")
        matcher = self._matcher
        # (after the first step, the previous step's advance() told: the state is unchanged)
        if matcher is not None and not self._stop_checked and matcher.is_stopped():
            return self._finish(None, FinishReason.STOP, None)
        raw = np.asarray(logits, dtype=np.float32).reshape(-1)[: self._vocab_size]
        drawn = -1  # a token drawn before the mask and taken by the constraint: 1 stopped, 0 not
        if matcher is not None:
            if matcher.plan:
                token, drawn = self._take_planned(raw, matcher, matcher.plan[-1])
            else:
                token, drawn = self._draw_first(raw, matcher) if self._draws_first else (-1, -1)
            if token < 0:
                token = self._draw_masked(raw, matcher)
        else:
            if self._edits_logits:
                work = self._scratch()[0][: raw.shape[0]]
                np.copyto(work, raw)
                self._apply_penalties(work)
                if self._holds_eos():
                    work[self._eos] = -np.inf
            else:
                work = raw  # read only from here on
            token = self._choose(work, constrained=False)
        logprob = self._logprob(raw, token) if self._logprobs is not None else None

        self._tokens.append(token)
        if token in self._eos_set:
            return self._finish(token, FinishReason.STOP, logprob)
        stopped = False
        if matcher is not None:
            stopped = matcher.advance(token) if drawn < 0 else drawn == 1
            self._stop_checked = True  # (when stopped, this step ends the generation)
        return self._taken(token, stopped, logprob)

    def step_forced(self) -> StepResult | None:
        """The next step when it needs no logits, else None (the engine runs the model and calls
        step()): the constraint allows exactly one token there (a forced state's, or the next of
        a planned forced run), taken as step() would take it, the same random number spent.

        An engine evaluates such tokens in one forward pass with the token before them
        (jump-forward decoding), so the model runs fewer times. From the same logits the tokens
        are step()'s; the logits after a run may differ from one-token passes in their last bits
        (another batch shape), which can turn a near-tie. Not with logprobs (each token's needs
        its logits); a forced token's own logit is not read, so a non-finite one is no error."""
        matcher = self._matcher
        if matcher is None or self._logprobs is not None or self._finished is not None:
            return None  # (jumps_forward is False, or the generation ended)
        if matcher.plan:
            token = matcher.plan[-1]
            if token >= self._vocab_size or token in self._eos_set:
                return None  # (step() takes it, or masks)
            if self._eos_ids and not self._holds_eos() and matcher.is_accepting():
                return None  # (EOS would be allowed besides: step() masks)
            stopped = matcher.try_advance(token)
            if stopped < 0:
                return None
            taken = stopped == 1
        else:
            # step() masks when it cannot draw first or the state is forced: the same mask here
            if self._draws_first and not matcher.is_forced():
                return None
            self._fill_mask()
            token = self._only_allowed(matcher, self._vocab_size)
            if token < 0:
                self._mask_ready = True  # the state is unchanged: step() uses this mask
                return None
            matcher.plan_forced_run(token)
            taken = matcher.advance(token)
        if not self._greedy:
            self._rng.random()  # what _choose_only spends
        self._stop_checked = True
        self._tokens.append(token)
        return self._taken(token, taken, None)

    def forced_steps(self, limit: int, going: Callable[[], bool]) -> Iterator[StepResult]:
        """step_forced's steps, one after another: at most `limit`, each only while `going()`
        (an engine's cancel and deadline: a forced token can cost milliseconds, a long literal
        re-tokenized at each without plans), ending with one that finished the generation."""
        for _ in range(limit):
            if not going():
                return
            step = self.step_forced()
            if step is None:
                return
            yield step
            if step.finished is not None:
                return

    def _taken(self, token: int, stopped: bool, logprob: TokenLogprob | None) -> StepResult:
        """The rest of a step once `token` (not EOS) is chosen and consumed: its text, stop
        strings, the constraint's end, max_tokens."""
        if self._penalized:
            self._record(token)
        self._decode(token)
        if len(self._tokens) <= self._min_tokens:
            self._stops_from = len(self._full)  # as vLLM: only text after min_tokens can stop
            stop = None
        else:
            stop = self._find_stop()
        if stop is not None:
            return self._finish(token, FinishReason.STOP_SEQUENCE, logprob, stop)
        if stopped:
            return self._finish(token, FinishReason.STOP, logprob)
        if self._max_tokens is not None and len(self._tokens) >= self._max_tokens:
            return self._finish(token, FinishReason.LENGTH, logprob)
        return StepResult(token, self._release(), logprob=logprob)

    def finalize(self) -> str:
        """Flushes held-back text (for ends the engine decides, e.g. cancellation); idempotent."""
        if self._matched_stop is None:
            tail = self._utf8.decode(b"", final=True) if self._mode == "bytes" else ""
            self._full += tail
        delta = self._full[self._emitted :]
        self._emitted = len(self._full)
        return delta

    # -- internals ------------------------------------------------------------------------

    def _finish(
        self, token: int | None, reason: FinishReason, logprob: TokenLogprob | None, stop: str | None = None
    ) -> StepResult:
        self._finished = reason
        self._matched_stop = stop
        return StepResult(token, self.finalize(), reason, stop, logprob)

    def _holds_eos(self) -> bool:
        return self._ignore_eos or len(self._tokens) < self._min_tokens

    def _record(self, token: int) -> None:
        self._counts[token] = self._counts.get(token, 0) + 1
        if token not in self._seen and 0 <= token < self._vocab_size:
            self._seen.add(token)
            self._seen_ids = None

    def _apply_penalties(self, work: FloatArray) -> None:
        if self._repetition is not None and self._seen:
            if self._seen_ids is None:
                self._seen_ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
            ids = self._seen_ids
            values = work[ids]
            work[ids] = np.where(values > 0, values / self._repetition, values * self._repetition)
        if (self._frequency or self._presence) and self._counts:
            ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            work[ids] -= counts * np.float32(self._frequency) + np.float32(self._presence)

    def _draw_first(self, raw: FloatArray, matcher: ConstraintMatcher) -> tuple[int, int]:
        """(token, 1 if the constraint stopped after it else 0) for a token drawn from all the
        logits that the constraint takes (consumed); (-1, -1) when not: step() then masks.

        The kept tokens follow the masked distribution (exactly, up to float32 rounding of the
        probabilities): a token t the constraint allows comes out with
        p(t) + (1 - p(allowed)) * p(t) / p(allowed) = p(t) / p(allowed). Most
        steps of a model that follows its schema skip the mask this way (llama.cpp's grammar
        sampler does the same). Only without top-k / top-p / min-p, which would cut the
        distribution before the mask instead of after it."""
        if matcher.is_forced():  # the mask keeps only the canonical token there: mask at once
            return -1, -1
        work = raw
        if self._penalized:
            work = self._scratch()[0][: raw.shape[0]]
            np.copyto(work, raw)
            self._apply_penalties(work)
        try:
            token = self._choose(work, constrained=False, normalize=False)
        except errors.Internal:  # NaN or infinite logits: the masked path sorts them out
            return -1, -1
        if token in self._eos_set:  # (it ends the generation unconsumed, as after the mask)
            return (token, 0) if not self._holds_eos() and matcher.is_accepting() else (-1, -1)
        if token >= matcher.vocab_size:
            return -1, -1
        stopped = matcher.try_advance(token)
        return (token, stopped) if stopped >= 0 else (-1, -1)

    def _take_planned(self, raw: FloatArray, matcher: ConstraintMatcher, token: int) -> tuple[int, int]:
        """(token, 1 if the constraint stopped after it else 0) for the next token of a long
        forced run planned at its start (ConstraintMatcher.plan_forced_run), taken as a mask of
        that one id would be; (-1, -1) when it cannot be (step() then masks, which ends the plan)."""
        if token >= raw.shape[0] or not self._only_logit_finite(raw, token):
            return -1, -1
        if self._eos_ids and not self._holds_eos() and matcher.is_accepting():
            return -1, -1  # (EOS would be allowed besides)
        stopped = matcher.try_advance(token)
        if stopped < 0:
            return -1, -1
        if not self._greedy:
            self._rng.random()  # what _choose_only spends
        return token, stopped

    def _draw_masked(self, raw: FloatArray, matcher: ConstraintMatcher) -> int:
        """A token drawn among those the constraint allows (its mask computed now, unless
        step_forced computed it for this state)."""
        if self._mask_ready:
            self._mask_ready = False
        else:
            self._fill_mask()
        only = self._only_allowed(matcher, raw.shape[0])
        if only >= 0:
            token = self._choose_only(raw, only)
            matcher.plan_forced_run(token)
            return token
        work = self._masked(raw, matcher)
        try:
            return self._choose(work, constrained=True)
        except errors.Internal:
            if not np.isnan(work).any():
                raise
            return self._choose(self._masked_exactly(raw), constrained=True)

    def _only_allowed(self, matcher: ConstraintMatcher, n: int) -> int:
        """The id when the mask just filled allows exactly one (and EOS is not allowed besides, by
        the rule of _masked), else -1. A forced state's mask is one token (the canonical one), so
        these steps skip the vocabulary-sized arithmetic of _masked and _choose."""
        words = self._bitmask
        if np.count_nonzero(words) != 1 or n < 4 or (self._min_p is not None and self._min_p > 1.0):
            return -1  # (_choose's own shortcut for one id holds for these only)
        word = int(words.nonzero()[0][0])
        bits = int(words[word]) & 0xFFFFFFFF
        if bits & (bits - 1):
            return -1
        token = 32 * word + bits.bit_length() - 1
        if token >= matcher.vocab_size or token >= n:
            return -1
        if self._eos_ids and (token in self._eos_set or (not self._holds_eos() and matcher.is_accepting())):
            return -1
        return token

    def _choose_only(self, raw: FloatArray, token: int) -> int:
        """What _choose(constrained=True) gives when `token` is the only id allowed: `token`, one
        random number spent unless greedy; the same error when its (penalized, scaled) logit is
        not finite."""
        if not self._only_logit_finite(raw, token):
            raise self._nothing_allowed()
        if not self._greedy:
            self._rng.random()
        return token

    def _only_logit_finite(self, raw: FloatArray, token: int) -> bool:
        """Whether `token`'s logit, penalized and scaled as _choose would, is finite."""
        value = raw[token]
        if self._penalized:
            work = self._scratch()[0][: raw.shape[0]]
            np.copyto(work, raw)
            self._apply_penalties(work)
            value = work[token]
        if not self._greedy and self._temperature != 1.0:
            value = value / np.float32(self._temperature)
        return math.isfinite(float(value))

    def _masked(self, raw: FloatArray, matcher: ConstraintMatcher) -> FloatArray:
        """The logits the constraint allows (the mask already filled), -inf elsewhere; EOS is
        allowed exactly when the output is complete (and EOS is not held back), whatever the mask
        says, then the penalties.

        The mask is one np.minimum with bounds (+inf / -inf); that equals masking the penalized
        logits except where a disallowed logit is NaN (it stays NaN): _draw_masked then redoes it
        exactly."""
        mask = self._mask
        _BYTE_MASKS.take(self._mask_bytes, axis=0, out=self._mask_rows)
        if self._mask_tail is not None:
            mask[self._mask_tail] = -np.inf
        if self._eos_ids:
            held = self._ignore_eos or len(self._tokens) < self._min_tokens  # _holds_eos()
            value = _DENY if held or not matcher.is_accepting() else _ALLOW
            for t in self._eos_ids:
                mask[t] = value
        work = self._scratch()[0][: raw.shape[0]]
        np.minimum(raw, mask[: raw.shape[0]], out=work)
        if self._penalized:
            self._apply_penalties(work)
        return work

    def _masked_exactly(self, raw: FloatArray) -> FloatArray:
        """_masked's result for logits with NaN where the (already computed) mask disallows."""
        work = self._scratch()[0][: raw.shape[0]]
        np.copyto(work, raw)
        np.copyto(work, _DENY, where=self._mask[: raw.shape[0]] < 0)
        self._apply_penalties(work)  # -inf stays -inf: the same as penalizing, then masking
        return work

    def _scratch(self) -> tuple[FloatArray, FloatArray, npt.NDArray[np.float64]]:
        """(logits, probabilities, cdf) buffers of vocabulary size, made on first use."""
        if self._buffers is None:
            n = self._vocab_size
            self._buffers = (np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float64))
        return self._buffers

    def _choose(self, work: FloatArray, *, constrained: bool, normalize: bool = True) -> int:
        if self._greedy:
            token = int(work.argmax())
            if not np.isfinite(work[token]):
                raise self._nothing_allowed()
            return token
        # Same arithmetic as the plain numpy expressions (bit for bit, so seeded outputs never
        # change), written into reused buffers.
        work_buf, probs_buf, cdf_buf = self._scratch()
        if self._temperature != 1.0:
            scaled = probs_buf[: work.shape[0]]
            np.divide(work, np.float32(self._temperature), out=scaled)
        else:
            scaled = work
        ids: npt.NDArray[np.int64] | None = None
        cand = scaled
        if constrained:
            # constrained states usually allow few tokens: sample among those only
            allowed = self._allowed[: scaled.shape[0]]
            np.greater(scaled, _DENY, out=allowed)
            count = np.count_nonzero(allowed)
            if count == 0:
                raise self._nothing_allowed()
            if count < scaled.shape[0] // 2:
                ids = allowed.nonzero()[0]
                if count == 1 and (self._min_p is None or self._min_p <= 1.0):
                    # what the draw below gives for one candidate (probability 1), the same
                    # random number spent
                    if not math.isfinite(float(scaled[ids[0]])):
                        raise self._nothing_allowed()
                    self._rng.random()
                    return int(ids[0])
                cand = scaled[ids]
        if self._top_k is not None and self._top_k < cand.shape[0]:
            best = np.argpartition(cand, -self._top_k)[-self._top_k :]
            ids = best if ids is None else ids[best]
            cand = cand[best]
        top = float(cand.max())
        if not math.isfinite(top):
            raise self._nothing_allowed()
        probs = probs_buf[: cand.shape[0]]  # may alias cand (scaled): computed elementwise
        np.subtract(cand, top, out=probs)
        np.exp(probs, out=probs)
        if normalize:  # (the draw below scales by cdf[-1]; top-p / min-p and old seeds need it)
            probs /= probs.sum()
        if self._top_p is not None:
            keep = _top_p_keep(probs, self._top_p, work_buf, cdf_buf)  # work is dead by now
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

    def _nothing_allowed(self) -> errors.Internal:
        return errors.Internal(
            "no token is allowed by the constraint at this point", reason="CONSTRAINT_DEAD_END"
        )

    def _logprob(self, raw: FloatArray, token: int) -> TokenLogprob:
        top = float(raw.max())
        log_z = top + float(np.log(np.exp(raw - top, dtype=np.float32).sum(dtype=np.float64)))
        alternatives: tuple[TopLogprob, ...] = ()
        k = min(self._logprobs or 0, raw.shape[0])
        if k > 0:
            best = np.argpartition(raw, -k)[-k:]
            best = best[np.argsort(-raw[best], kind="stable")]
            alternatives = tuple(TopLogprob(self._piece(int(t)), float(raw[t]) - log_z, int(t)) for t in best)
        return TokenLogprob(self._piece(token), float(raw[token]) - log_z, token, alternatives)

    def _piece(self, token: int) -> str:
        piece = self._piece_cache.get(token)
        if piece is None:
            out = self._detokenize([token])
            piece = out.decode("utf-8", errors="replace") if isinstance(out, bytes) else out
            self._piece_cache[token] = piece
        return piece

    def _decode(self, token: int) -> None:
        if self._mode is None:
            first = self._detokenize([token])
            if isinstance(first, bytes):
                self._mode = "bytes"
                self._full += self._utf8.decode(first)
                return
            self._mode = "str"
        if self._mode == "bytes":
            out = self._detokenize([token])
            assert isinstance(out, bytes)
            self._full += self._utf8.decode(out)
            return
        # str mode: decode a short window so tokenizers that merge pieces (SentencePiece
        # spaces, multi-token characters) give the same text as decoding everything at once.
        self._text_tokens.append(token)
        prefix = self._as_str(self._text_tokens[self._prefix_offset : self._read_offset])
        current = self._as_str(self._text_tokens[self._prefix_offset :])
        if len(current) > len(prefix) and not current.endswith("\ufffd"):
            self._full += current[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._text_tokens)

    def _as_str(self, tokens: list[int]) -> str:
        if not tokens:
            return ""
        out = self._detokenize(tokens)
        return out.decode("utf-8", errors="replace") if isinstance(out, bytes) else out

    def _find_stop(self) -> str | None:
        """Cuts _full at the earliest stop string that appeared; returns it, or None."""
        if not self._stops:
            return None
        start = max(0, self._emitted - self._max_stop + 1, self._stops_from)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._full.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        self._full = self._full[: best[0]]
        self._emitted = min(self._emitted, best[0])
        return best[1]

    def _release(self) -> str:
        """Hands out new text, keeping back a tail that could still become a stop string."""
        end = len(self._full)
        if self._stops:
            hold = 0
            pending = end - self._emitted
            for stop in self._stops:
                for k in range(min(len(stop) - 1, pending), hold, -1):
                    if self._full.endswith(stop[:k]):
                        hold = k
                        break
            end -= hold
        delta = self._full[self._emitted : end]
        self._emitted = end
        return delta


class LoopHandoff(Generic[T]):
    """Hands items from an engine's model thread to the event loop, waking it as rarely as latency allows.

    Waking the loop from another thread costs more than a tiny model's token. So the first item
    wakes the loop at once; after each batch the loop waits COALESCE_S (a timer on the loop, no
    wake-ups meanwhile) and then takes everything that arrived. When nothing arrived, the worker's
    next item wakes it at once again: tokens slower than COALESCE_S are each delivered at once,
    faster ones at most COALESCE_S late. The last item (`put(..., last=True)`) is never delayed.
    """

    COALESCE_S = 0.001

    def __init__(self, loop: asyncio.AbstractEventLoop, on_closed: Callable[[T], None]) -> None:
        self._loop = loop
        self._on_closed = on_closed
        self._items: deque[T] = deque()
        self._wake_pending = False  # set: the worker does not wake the loop (one is on its way)
        self._last = False
        self._batch_at: float | None = None  # loop time of the previous batch
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: T, *, last: bool = False, more: bool = False) -> None:
        """Worker thread: queues an item, waking the loop if it waits for one (or if `last`).

        `more`: another put follows at once, so this one never wakes the loop (that one will).
        """
        self._items.append(item)  # appended before the flag is read: see take()
        if more:
            return
        if last:
            self._last = True
        elif self._wake_pending and not self._loop.is_closed():
            return
        self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop closed: nobody waits for this item any more
            self._on_closed(item)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, timeout: float | None) -> None:
        self._waiter = self._loop.create_future()
        timer = None if timeout is None else self._loop.call_later(timeout, self._wake)
        try:
            await self._waiter  # a stale wake-up may end this early: callers check again
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def take(self) -> list[T]:
        """Event loop: waits for items and returns all that are queued (at least one)."""
        if self._batch_at is not None and not self._last:
            delay = self._batch_at + self.COALESCE_S - self._loop.time()
            if delay > 0:
                await self._wait(delay)
        while True:
            if self._items:
                self._batch_at = self._loop.time()
                items = list(self._items)
                for _ in items:
                    self._items.popleft()
                return items
            # Nothing came: let the worker wake us. The flag is cleared before looking again,
            # so an item the look misses finds it clear and wakes us.
            self._batch_at = None
            self._wake_pending = False
            if not self._items:
                await self._wait(None)


_ALLOW = np.float32(np.inf)
_DENY = np.float32(-np.inf)
# Row b: the bounds (+inf allowed, -inf not) of the 8 tokens whose bits are byte b, lowest bit first.
_BYTE_MASKS = np.where(
    (np.arange(256, dtype=np.uint16)[:, None] >> np.arange(8, dtype=np.uint16)) & 1, _ALLOW, _DENY
).astype(np.float32)


def _top_p_keep(
    probs: FloatArray, top_p: float, sort_buf: FloatArray, cdf_buf: npt.NDArray[np.float64]
) -> npt.NDArray[np.int64]:
    """Indices of the most likely entries whose mass first reaches top_p (ties at the edge kept).

    A plain value sort (SIMD, ~20x faster than argsort at 128k) finds the threshold probability;
    one comparison then selects the nucleus. The buffers are scratch space of probs' size or more.
    """
    ordered = sort_buf[: probs.shape[0]]
    np.copyto(ordered, probs)
    ordered.sort()
    ordered = ordered[::-1]
    cdf = _cumsum64(ordered, cdf_buf)
    cut = min(int(cdf.searchsorted(top_p * cdf[-1], side="left")), ordered.shape[0] - 1)
    return np.flatnonzero(probs >= ordered[cut])


def _cumsum64(values: npt.NDArray[np.float32], buf: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """np.cumsum(values, dtype=np.float64), bit for bit, written into `buf` (faster: no mixed types)."""
    out = buf[: values.shape[0]]
    np.copyto(out, values)
    np.add.accumulate(out, out=out)
    return out
