"""One rule for a structured output that fails validation, on every backend: it is tried again
VALIDATION_RETRIES more times (local engines re-sample it with another seed, providers re-ask
with the error), then refused with ABORTED VALIDATION_FAILED. Every backend's retry loop counts
its tries with `Attempts`, so they stop at the same count with the same error (and each try made
again is noted for the metrics of the call: gengate.observation)."""

from __future__ import annotations

from gengate import errors
from gengate.domain import ConstraintKind
from gengate.observation import REASK, RESAMPLE, current_notes, note_validation_retry

VALIDATION_RETRIES = 2
VALIDATION_FAILED = "VALIDATION_FAILED"


def validation_failed(
    index: int, tries: int, problem: str, *, kind: ConstraintKind | None = None, source: str | None = None
) -> errors.Aborted:
    """The error for generation `index` still invalid after `tries` tries; `source` names the
    provider whose output it was."""
    whose = f"{source} output for generation {index}" if source else f"generation {index}"
    return errors.Aborted(
        f"{whose} did not validate in {tries} tries: {problem}",
        reason=VALIDATION_FAILED,
        metadata={"constraint_kind": kind.value} if kind is not None else None,
    )


class Attempts:
    """The validation tries of one request's generations: which failed their last try, why, and
    whether they may be tried again (`retries` more times after the first)."""

    def __init__(
        self,
        retries: int = VALIDATION_RETRIES,
        *,
        kind: ConstraintKind | None = None,
        source: str | None = None,
    ) -> None:
        self.tries = 1 + retries
        self.kind = kind
        self.source = source
        # generation index -> (why its last try failed, the text it produced)
        self.failing: dict[int, tuple[str, str]] = {}
        self._used: dict[int, int] = {}
        # Taken now, in the call's context: engines may run the tries from a scheduler's task.
        self._notes = current_notes()

    def failed(self, index: int, problem: str, text: str = "") -> bool:
        """Records that a try of generation `index` did not validate; True when it may be tried again."""
        self._used[index] = self._used.get(index, 0) + 1
        self.failing[index] = (problem, text)
        again = self._used[index] < self.tries
        if again:
            note_validation_retry(self._notes, REASK if self.source else RESAMPLE)
        return again

    def passed(self, index: int) -> None:
        """Records that generation `index` validated."""
        self.failing.pop(index, None)

    def to_retry(self) -> list[int]:
        """The generations to try again, in order (none: all validated); raises the refusal of the
        first that has no try left."""
        exhausted = [i for i in self.failing if self._used[i] >= self.tries]
        if exhausted:
            raise self.refusal(min(exhausted))
        return sorted(self.failing)

    def refusal(self, index: int) -> errors.Aborted:
        """ABORTED VALIDATION_FAILED for generation `index`, with its last problem."""
        problem, _ = self.failing[index]
        return validation_failed(index, self._used[index], problem, kind=self.kind, source=self.source)
