"""Mask filling for test matchers: what ConstraintMatcher.bind_mask returns, from booleans."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np


def packed_mask_filler(
    row: np.ndarray, vocab_size: int, allowed: Callable[[], np.ndarray]
) -> Callable[[], None]:
    """A fill() that writes `allowed()` (booleans over a grammar vocabulary of `vocab_size`) into
    the int32 `row` as llguidance does: bit i of word i // 32 for token i."""

    def fill() -> None:
        bits = np.zeros(row.size * 32, dtype=np.bool_)
        bits[:vocab_size] = allowed()
        row[:] = np.packbits(bits, bitorder="little").view(np.int32)

    return fill


class WithoutPlans:
    """The forced-run plans of ConstraintMatcher, never made: for test matchers whose masks
    are scripted (the decoder reads `plan` each step and offers a plan at one-id masks)."""

    plan: ClassVar[list[int]] = []  # never filled: plan_forced_run makes none

    def plan_forced_run(self, first: int) -> None:
        pass
