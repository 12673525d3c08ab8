"""One rule for a structured output that fails validation, on every backend: it is tried again
VALIDATION_RETRIES more times (local engines re-sample it with another seed, providers re-ask
with the error), then refused with ABORTED VALIDATION_FAILED."""

from __future__ import annotations

from gengate import errors
from gengate.domain import ConstraintKind

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
