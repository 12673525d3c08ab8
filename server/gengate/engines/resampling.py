"""Re-sampling of VALIDATED generations, shared by the local engines.

A relaxed constraint (one `constraints.lowering` could not enforce keyword for keyword) is
enforced by the engine as far as it goes and checked afterwards. Each generation's text is held
back until it validates; one that does not is sampled again with another seed, as many times
as `constraints.retries` says for every backend, then refused with ABORTED VALIDATION_FAILED.
A generation cut by max_tokens or a stop string is released as it is: its finish reason says
it is incomplete.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing

from gengate.constraints import validate_output
from gengate.constraints.retries import Attempts
from gengate.domain import (
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    StreamEvent,
    StructuredOutput,
    merge_deltas,
)

_SEED_STEP = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: attempts' seeds far apart
_SEED_MASK = (1 << 63) - 1  # every engine takes a non-negative 63-bit seed

# run(indices, attempt): the events of generations `indices` (with those indices), sampled with
# the seed of `attempt` (0 = the request's own). No StreamStart.
GenerationRunner = Callable[[Sequence[int], int], AsyncGenerator[StreamEvent, None]]


def retry_seed(seed: int, attempt: int) -> int:
    """The seed of validation attempt `attempt`: reproducible from the request's seed."""
    return (seed + attempt * _SEED_STEP) & _SEED_MASK


def all_generations(
    request: GenerationRequest,
    enforcement: Enforcement,
    run: GenerationRunner,
    answer: Callable[[str], str] | None = None,
) -> AsyncGenerator[StreamEvent, None]:
    """The request's n generations from `run`: as they come, or held back and re-sampled until
    they validate when its constraint is only VALIDATED (`answer`: the part of a generation's
    text the constraint holds for, when a think block comes first)."""
    if enforcement is Enforcement.VALIDATED and request.structured_output is not None:
        return validated_events(request.structured_output, request.n, run, answer)
    return run(range(request.n), 0)


async def validated_events(
    structured: StructuredOutput, n: int, run: GenerationRunner, answer: Callable[[str], str] | None = None
) -> AsyncGenerator[StreamEvent, None]:
    """Generations 0..n-1 from `run`, each released (one merged delta, then its end) once its
    text validates; those that fail are run again together, with the next attempt's seed."""
    attempts = Attempts()
    indices: Sequence[int] = range(n)
    attempt = 0
    while indices:
        held: dict[int, list[GenerationDelta]] = {i: [] for i in indices}
        async with aclosing(run(indices, attempt)) as events:
            async for event in events:
                if isinstance(event, GenerationDelta):
                    held[event.index].append(event)
                    continue
                if not isinstance(event, GenerationEnd):
                    continue
                deltas = held.pop(event.index)
                complete = event.finish_reason is FinishReason.STOP
                text = "".join(d.text for d in deltas)
                problem = validate_output(structured, answer(text) if answer else text) if complete else None
                if problem is not None:
                    attempts.failed(event.index, problem)
                    continue
                attempts.passed(event.index)
                if deltas:
                    yield merge_deltas(deltas)
                yield event
        indices = attempts.to_retry()
        attempt += 1
