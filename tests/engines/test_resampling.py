"""Re-sampling of VALIDATED generations (engines/resampling.py), with a scripted runner."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

import pytest
from gengate import errors
from gengate.constraints.retries import VALIDATION_RETRIES
from gengate.domain import (
    ChoiceConstraint,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    StreamEvent,
    StructuredOutput,
    Usage,
)
from gengate.engines.resampling import retry_seed, validated_events

CHOICE = StructuredOutput(ChoiceConstraint(("yes", "no")))


class ScriptedRunner:
    """Answers generation i of attempt a with texts[(i, a)] (default "yes"), in two deltas."""

    def __init__(self, texts: dict[tuple[int, int], str], reason: FinishReason = FinishReason.STOP) -> None:
        self.texts = texts
        self.reason = reason
        self.calls: list[tuple[list[int], int]] = []
        self.closed = 0

    async def __call__(self, indices: Sequence[int], attempt: int) -> AsyncGenerator[StreamEvent, None]:
        self.calls.append((list(indices), attempt))
        try:
            for index in indices:
                text = self.texts.get((index, attempt), "yes")
                half = len(text) // 2
                yield GenerationDelta(index, text[:half], 1)
                yield GenerationDelta(index, text[half:], 2)
                yield GenerationEnd(index, self.reason, Usage(5, 3))
        finally:
            self.closed += 1


async def _collect(runner: ScriptedRunner, n: int) -> list[StreamEvent]:
    return [e async for e in validated_events(CHOICE, n, runner)]


async def test_valid_generations_are_released_whole_and_failed_ones_run_again_together() -> None:
    runner = ScriptedRunner({(1, 0): "maybe", (3, 0): "nope", (3, 1): "sure", (3, 2): "no"})
    events = await _collect(runner, 4)
    assert runner.calls == [([0, 1, 2, 3], 0), ([1, 3], 1), ([3], 2)]
    texts = {e.index: e.text for e in events if isinstance(e, GenerationDelta)}
    assert texts == {0: "yes", 1: "yes", 2: "yes", 3: "no"}
    # one merged delta per generation, right before its end, token counts kept
    for delta, end in zip(events[::2], events[1::2], strict=True):
        assert isinstance(delta, GenerationDelta) and isinstance(end, GenerationEnd)
        assert delta.index == end.index and delta.token_count == 3
    assert sorted(e.index for e in events if isinstance(e, GenerationEnd)) == [0, 1, 2, 3]
    assert runner.closed == 3


async def test_a_generation_that_never_validates_is_refused_after_the_retries() -> None:
    runner = ScriptedRunner({(2, a): "maybe" for a in range(VALIDATION_RETRIES + 1)})
    released: list[StreamEvent] = []
    with pytest.raises(errors.Aborted) as info:
        async for event in validated_events(CHOICE, 3, runner):
            released.append(event)
    assert info.value.reason == "VALIDATION_FAILED"
    assert f"generation 2 did not validate in {VALIDATION_RETRIES + 1} tries" in info.value.message
    assert len(runner.calls) == VALIDATION_RETRIES + 1
    assert all(e.index != 2 for e in released if isinstance(e, GenerationDelta | GenerationEnd))


async def test_cut_generations_are_released_unvalidated() -> None:
    runner = ScriptedRunner({(0, 0): "ma"}, reason=FinishReason.LENGTH)
    events = await _collect(runner, 1)
    assert runner.calls == [([0], 0)]
    assert isinstance(events[0], GenerationDelta) and events[0].text == "ma"


async def test_closing_early_closes_the_engine_run() -> None:
    runner = ScriptedRunner({})
    events = validated_events(CHOICE, 2, runner)
    assert isinstance(await anext(events), GenerationDelta)
    await events.aclose()
    assert runner.closed == 1


def test_retry_seeds_are_reproducible_distinct_and_63_bit() -> None:
    seeds = [retry_seed(2**63 - 5, attempt) for attempt in range(VALIDATION_RETRIES + 1)]
    assert seeds[0] == 2**63 - 5
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [retry_seed(2**63 - 5, attempt) for attempt in range(VALIDATION_RETRIES + 1)]
