"""constraints.retries.Attempts: the one count every backend's retry-until-valid loop stops at."""

from __future__ import annotations

import pytest
from gengate import errors
from gengate.constraints.retries import VALIDATION_FAILED, VALIDATION_RETRIES, Attempts
from gengate.domain import ConstraintKind


def test_a_generation_gets_the_first_try_and_the_retries_then_the_refusal() -> None:
    attempts = Attempts(kind=ConstraintKind.REGEX, source="prov")
    allowed = [attempts.failed(1, f"bad {t}", f"text {t}") for t in range(1 + VALIDATION_RETRIES)]
    assert allowed == [True] * VALIDATION_RETRIES + [False]
    with pytest.raises(errors.Aborted) as caught:
        attempts.to_retry()
    assert caught.value.reason == VALIDATION_FAILED
    assert f"in {1 + VALIDATION_RETRIES} tries" in str(caught.value)
    assert f"bad {VALIDATION_RETRIES}" in str(caught.value)  # the last problem, not the first
    assert "prov output for generation 1" in str(caught.value)


def test_only_failing_generations_are_retried_in_order_and_a_pass_clears_one() -> None:
    attempts = Attempts(retries=1)
    assert attempts.to_retry() == []
    attempts.failed(3, "x")
    attempts.failed(0, "y")
    assert attempts.to_retry() == [0, 3]
    assert attempts.failing[3] == ("x", "")
    attempts.passed(3)
    assert attempts.to_retry() == [0]
    attempts.failed(0, "again")
    with pytest.raises(errors.Aborted, match="generation 0 did not validate in 2 tries: again"):
        attempts.to_retry()


def test_no_retries_refuses_after_one_try() -> None:
    attempts = Attempts(0)
    assert attempts.failed(0, "nope") is False
    with pytest.raises(errors.Aborted, match="in 1 tries"):
        attempts.to_retry()
