"""ConstraintMatcher: one generation's view of a compiled grammar (wraps llguidance's LLMatcher)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from llguidance import LLMatcher, LLTokenizer

from gengate import errors
from gengate.constraints.tokenizers import longest_token_bytes

# Forced runs at least this long are tokenized once, where they start (plan_forced_run): in a
# forced state llguidance's mask tokenizes all the forced bytes that remain, so a long literal
# would cost its length at every one of its tokens (~24 ms a token at 100 KB on tiny).
PLAN_BYTES = 256


class ConstraintMatcher:
    """Per-generation token mask and state; never shared between generations.

    The mask covers the grammar tokenizer's vocabulary (`vocab_size`); logits beyond it
    (padded model vocabularies) must be treated as disallowed by the caller.
    `planner`, the grammar's tokenizer, allows plan_forced_run (None: no plans, e.g. under
    `no_forcing`, where a forced state's mask is more than its forced token).
    """

    def __init__(self, matcher: LLMatcher, vocab_size: int, *, planner: LLTokenizer | None = None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._bitmask = np.zeros(self._words, dtype=np.int32)
        self._planner = planner
        # The rest of a long forced run planned here (plan_forced_run), its next token last; a
        # decoder reads it every step (an attribute: cheaper than a call), masking when empty.
        self.plan: list[int] = []
        self._forced: int | None = None  # forced bytes at this state, when is_forced has looked
        if matcher.is_error():
            raise matcher_error(matcher.get_error(), "constraint matcher failed to start")

    def fill_mask(self, bitmask_row: npt.NDArray[np.int32]) -> None:
        """Writes the allowed-token bitmask (bit i of word i//32 = token i) into a contiguous int32 row."""
        if bitmask_row.dtype != np.int32 or not bitmask_row.flags["C_CONTIGUOUS"]:
            raise ValueError("bitmask row must be a contiguous int32 array")
        if bitmask_row.size < self._words:
            raise ValueError(f"bitmask row needs {self._words} words, got {bitmask_row.size}")
        self._matcher.unsafe_compute_mask_ptr(bitmask_row.ctypes.data, self._words * 4)
        self._raise_if_error()

    def bind_mask(self, bitmask_row: npt.NDArray[np.int32]) -> Callable[[], None]:
        """fill_mask for one row, checked once here: the returned call writes the next mask into
        `bitmask_row` without re-checking it (its address read once), for a decoder's own buffer."""
        if bitmask_row.dtype != np.int32 or not bitmask_row.flags["C_CONTIGUOUS"]:
            raise ValueError("bitmask row must be a contiguous int32 array")
        if bitmask_row.size < self._words:
            raise ValueError(f"bitmask row needs {self._words} words, got {bitmask_row.size}")
        compute = self._matcher.unsafe_compute_mask_ptr
        is_error = self._matcher.is_error
        address, size = bitmask_row.ctypes.data, self._words * 4

        def fill(_row: npt.NDArray[np.int32] = bitmask_row) -> None:  # the default keeps the row alive
            compute(address, size)
            if is_error():
                self._raise_if_error()

        return fill

    def allowed_token_mask(self) -> npt.NDArray[np.bool_]:
        """Booleans over the grammar vocabulary: True where the next token may be that id."""
        self.fill_mask(self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(np.bool_)

    def consume(self, token_id: int) -> None:
        """Advances past `token_id`; raises Internal if the grammar does not allow it."""
        if not self._matcher.consume_token(token_id):
            raise matcher_error(self._matcher.get_error(), f"constraint rejected token {token_id}")
        self._forced = None
        if self.plan:
            self._follow_plan(token_id)

    def advance(self, token_id: int) -> bool:
        """consume(token_id), then is_stopped(): one call per token for a decoder."""
        matcher = self._matcher
        if not matcher.consume_token(token_id):
            raise matcher_error(matcher.get_error(), f"constraint rejected token {token_id}")
        self._forced = None
        if self.plan:
            self._follow_plan(token_id)
        return bool(matcher.is_stopped()) and not matcher.is_error()

    def is_forced(self) -> bool:
        """True when the grammar forces the next bytes: there the mask keeps only the canonical
        token (`{"`, not `{` then `"`), though a consume would take either. (llguidance moves
        the forced bytes into its parser as it answers, even for a grammar with `no_forcing`;
        the mask stays the same, test_try_advance.py holds it.) Asked once per state: a decoder
        asks again in the same state after step_forced."""
        forced = self._forced
        if forced is None:
            forced = self._forced = len(self._matcher.compute_ff_bytes())
        return forced > 0

    def try_advance(self, token_id: int) -> int:
        """For a token drawn without the mask, in a state that is not forced: 1 (consumed, now
        stopped) or 0 (consumed) when the mask allows it, -1 (nothing changed) when not.

        Outside forced states llguidance's mask is exactly the set of tokens a consume takes
        (tests/constraints/test_try_advance.py holds the two equal over many constraints)."""
        matcher = self._matcher
        if matcher.try_consume_tokens([token_id]) != 1:
            return -1
        self._forced = None
        if self.plan:
            self._follow_plan(token_id)
        return 1 if matcher.is_stopped() and not matcher.is_error() else 0

    def plan_forced_run(self, first: int) -> None:
        """At a forced state whose mask allows only `first`: when PLAN_BYTES or more are forced,
        tokenizes them once (llguidance's own forced tokens, `first` theirs too); `plan` then
        holds the run's next tokens, where a mask each would tokenize all that remains again.

        The plan stops twice the longest token's bytes short of the run's end: there a mask may
        allow more than one token (what follows the run may join its last bytes), and masks take
        over. Before that every mask is one token too, but masks re-tokenize from the last token
        on, which can split differently from the whole run's tokenization the plan holds (`'s`
        after `}{`); both spell the run's bytes (tests/constraints/test_forced_runs.py)."""
        if self._planner is None or self.plan:
            return
        forced = self._forced
        if forced is None:
            forced = self._forced = len(self._matcher.compute_ff_bytes())
        if forced < PLAN_BYTES:
            return
        tokens = self._matcher.compute_ff_tokens()
        if len(tokens) < 2 or tokens[0] != first:
            return
        until = forced - 2 * longest_token_bytes(self._planner)
        spelled, kept = 0, 0
        for token in tokens:
            spelled += len(self._planner.decode_bytes([token]))
            if spelled > until:
                break
            kept += 1
        if kept > 1:
            self.plan = tokens[kept - 1 :: -1]

    def _follow_plan(self, token_id: int) -> None:
        """After a consume: the plan goes on when it was its token, and ends when not."""
        if self.plan[-1] == token_id:
            self.plan.pop()
        else:
            self.plan.clear()

    def is_accepting(self) -> bool:
        """True when the output so far is complete (EOS may end the generation here)."""
        return bool(self._matcher.is_accepting())

    def is_stopped(self) -> bool:
        """True when nothing more can follow: the generation is complete (FinishReason.STOP)."""
        return bool(self._matcher.is_stopped()) and not self._matcher.is_error()

    def is_error(self) -> bool:
        return bool(self._matcher.is_error())

    def forced_bytes(self) -> bytes:
        """Bytes the grammar forces next, whatever the model says."""
        return bytes(self._matcher.compute_ff_bytes())

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise matcher_error(self._matcher.get_error(), "constraint matcher error")


# llguidance's words when a constraint outgrows its resource limits (lexer fuel, lexer states,
# Earley items, grammar size): the caller's constraint is too complex, not a server fault.
_RESOURCE_WORDS = ("too many", "fuel", "limit", "too large", "too big", "max_")


def matcher_error(message: str, what: str) -> errors.GengateError:
    """INVALID_ARGUMENT when the grammar engine ran out of a resource limit on the constraint, or
    when the output so far can be completed in no way (a grammar such as `r: "a" r2; r2: r2`,
    whose rules never end: nothing is allowed next and nothing is complete); INTERNAL (a bug of
    ours: a token outside the mask was sampled) otherwise."""
    text = errors.brief(message)
    if "NoExtension" in message:
        return errors.InvalidArgument(
            f"the constraint admits no complete output: after what was generated, nothing can "
            f"follow and nothing is finished ({text})",
            reason="CONSTRAINT_UNSATISFIABLE",
        )
    if any(word in message.lower() for word in _RESOURCE_WORDS):
        return errors.InvalidArgument(
            f"the constraint is too complex for the grammar engine's limits: {text}",
            reason="CONSTRAINT_TOO_COMPLEX",
        )
    return errors.Internal(f"{what}: {text}", reason="CONSTRAINT_REJECTED_TOKEN")
