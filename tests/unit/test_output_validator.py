"""The output validator's time budget: a validation that overruns it is ABORTED
VALIDATION_TIMEOUT (the output is never returned unchecked), and one that cannot start because
every validator is busy is RESOURCE_EXHAUSTED VALIDATORS_BUSY with RetryInfo. The validations
here block on events the test holds, so what happens does not depend on the machine's speed."""

from __future__ import annotations

import asyncio
import threading

import pytest
from gengate.errors import Aborted, ResourceExhausted
from gengate.service import OutputValidator


async def test_a_validation_over_its_budget_is_a_timeout_never_a_pass() -> None:
    validator = OutputValidator(0.5, threads=1)
    release = threading.Event()
    try:
        with pytest.raises(Aborted) as caught:
            await validator._off_loop(lambda: release.wait() and None, "checking it", "validated")
        assert caught.value.reason == "VALIDATION_TIMEOUT"
        assert caught.value.metadata == {"enforcement": "validated"}
        assert "checking it took over 0.5 s" in caught.value.message
    finally:
        release.set()
        validator.close()


async def test_a_validation_that_cannot_start_finds_the_validators_busy() -> None:
    validator = OutputValidator(0.5, threads=1)
    release, running = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        release.wait()

    try:
        first = asyncio.ensure_future(validator._off_loop(hold, "the first", "validated"))
        await asyncio.to_thread(running.wait)  # the one validator thread is taken
        with pytest.raises(ResourceExhausted) as caught:
            await validator._off_loop(lambda: None, "the second", "validated")
        assert caught.value.reason == "VALIDATORS_BUSY" and caught.value.retry_after_s == 1.0
        assert caught.value.message == "the output validators are busy; try again shortly"
        with pytest.raises(Aborted):  # the first ran out of time while it ran
            await first
    finally:
        release.set()
        validator.close()


async def test_a_validation_within_its_budget_answers() -> None:
    validator = OutputValidator(5.0, threads=1)
    try:
        assert await validator._off_loop(lambda: "too short", "checking it", "validated") == "too short"
        assert await validator._off_loop(lambda: None, "checking it", "validated") is None
    finally:
        validator.close()
