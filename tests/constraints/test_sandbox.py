"""The constraint sandbox: a crash or a bomb costs the request that sent it, a check over its
budget is killed (its process stops consuming CPU), a busy pool says RESOURCE_EXHAUSTED, and
verdicts are cached."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest
from gengate import errors
from gengate.constraints.sandbox import ConstraintSandbox, judge
from gengate.domain import (
    GrammarConstraint,
    GrammarSyntax,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuredOutput,
)
from gengate.limits import RequestLimits


def chain(rules: int) -> StructuredOutput:
    """A Lark chain of rules: ~3,000 overflow llguidance's stack (SIGSEGV) when compiled."""
    text = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(rules)) + f'r{rules}: "x"\n'
    return StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, text))


async def frozen(limits: RequestLimits) -> ConstraintSandbox:
    """A sandbox whose one checker is started, then stopped (SIGSTOP): a check sent to it can
    never answer, whatever the machine's speed, so it is over any budget."""
    box = ConstraintSandbox(limits)
    await box.check(StructuredOutput(RegexConstraint("warm")), trial_compile=True)
    for pid in box.pids:
        os.kill(pid, signal.SIGSTOP)
    return box


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
async def sandbox() -> AsyncIterator[ConstraintSandbox]:
    box = ConstraintSandbox(RequestLimits(constraint_check_timeout_s=60))
    yield box
    await box.aclose()


async def test_a_good_constraint_passes_and_its_verdict_is_cached(sandbox: ConstraintSandbox) -> None:
    good = StructuredOutput(RegexConstraint(r"[0-9]{3}-[a-z]+"))
    await sandbox.check(good, trial_compile=True)
    await sandbox.check(good, trial_compile=True)
    assert sandbox.checks_run == 1


async def test_a_refusal_names_the_field_and_is_cached(sandbox: ConstraintSandbox) -> None:
    for _ in range(2):
        with pytest.raises(errors.InvalidArgument) as caught:
            await sandbox.check(StructuredOutput(JsonSchemaConstraint({"type": 5})), trial_compile=True)
        assert caught.value.reason == "INVALID_SCHEMA"
        assert caught.value.violations[0].field == "structured_output.json_schema.schema"
    assert sandbox.checks_run == 1


async def test_a_constraint_that_crashes_the_grammar_engine_costs_only_its_check(
    sandbox: ConstraintSandbox,
) -> None:
    await sandbox.check(StructuredOutput(RegexConstraint("a+")), trial_compile=True)
    before = set(sandbox.pids)
    with pytest.raises(errors.InvalidArgument) as caught:
        await sandbox.check(chain(5000), trial_compile=True)
    assert caught.value.reason == "CONSTRAINT_TOO_COMPLEX"
    assert "stack or memory" in caught.value.message
    assert sandbox.killed == 2  # tried once more on a fresh checker before blaming the constraint
    # the crashed checker was replaced; the pool answers the next check
    await sandbox.check(StructuredOutput(RegexConstraint("b+")), trial_compile=True)
    assert set(sandbox.pids) != before or len(before) > 1


async def test_a_check_over_its_budget_is_killed_and_stops_consuming_cpu() -> None:
    box = await frozen(RequestLimits(constraint_check_timeout_s=0.2))
    try:
        [pid] = box.pids
        with pytest.raises(errors.InvalidArgument) as caught:
            await box.check(StructuredOutput(RegexConstraint("[a-z]+")), trial_compile=True)
        assert caught.value.reason == "CONSTRAINT_TOO_COMPLEX"
        assert box.killed == 1 and not alive(pid)  # killed, not left running
        await box.check(StructuredOutput(RegexConstraint("[0-9]+")), trial_compile=True)  # replaced
    finally:
        await box.aclose()


async def test_a_full_pool_answers_resource_exhausted_with_retry_info() -> None:
    box = await frozen(
        RequestLimits(constraint_checkers=1, max_pending_constraint_checks=0, constraint_check_timeout_s=1)
    )
    try:
        held = asyncio.create_task(box.check(StructuredOutput(RegexConstraint("held")), trial_compile=True))
        while box.pending == 0:  # the held check occupies the only (stopped) checker
            await asyncio.sleep(0.01)
        with pytest.raises(errors.ResourceExhausted) as caught:
            await box.check(StructuredOutput(RegexConstraint("x")), trial_compile=True)
        assert caught.value.reason == "CONSTRAINT_CHECKERS_BUSY"
        assert caught.value.retry_after_s is not None and caught.value.retry_after_s > 0
        held.cancel()  # the caller goes; its check runs to its verdict (shared, cached)
        await asyncio.gather(held, return_exceptions=True)
        while box.pending:
            await asyncio.sleep(0.05)
        await box.check(StructuredOutput(RegexConstraint("y")), trial_compile=True)
    finally:
        await box.aclose()


async def test_identical_checks_in_flight_share_one_run(sandbox: ConstraintSandbox) -> None:
    same = StructuredOutput(RegexConstraint("[a-c]{3}"))
    await asyncio.gather(*(sandbox.check(same, trial_compile=True) for _ in range(6)))
    assert sandbox.checks_run == 1


async def test_a_checker_killed_from_outside_is_not_blamed_on_the_next_constraint(
    sandbox: ConstraintSandbox,
) -> None:
    await sandbox.check(StructuredOutput(RegexConstraint("warm")), trial_compile=True)
    for pid in sandbox.pids:
        os.kill(pid, 9)  # the OOM killer, an operator: the idle checker is gone
    await asyncio.sleep(0.1)
    await sandbox.check(StructuredOutput(RegexConstraint("[0-9]+")), trial_compile=True)
    assert sandbox.killed == 1


async def test_cancelling_a_caller_while_its_checker_starts_leaves_no_process() -> None:
    box = ConstraintSandbox(RequestLimits())
    try:
        task = asyncio.create_task(box.check(StructuredOutput(RegexConstraint("z")), trial_compile=True))
        await asyncio.sleep(0.05)  # the checker process is starting
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        while box.pending:
            await asyncio.sleep(0.05)
        await box.check(StructuredOutput(RegexConstraint("z2")), trial_compile=True)
        assert len(box.pids) == 1
    finally:
        await box.aclose()


def test_judge_turns_library_failures_into_short_caller_errors() -> None:
    """In-process: every outcome of judging is a verdict, never an exception."""
    cases = [
        StructuredOutput(JsonSchemaConstraint({"$ref": "#"})),
        StructuredOutput(JsonSchemaConstraint({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})),
        StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, "start: start")),
        StructuredOutput(GrammarConstraint(GrammarSyntax.GBNF, "root ::= ((( [ \\")),
        StructuredOutput(RegexConstraint("(" * 1000 + "a" + ")" * 1000)),
        StructuredOutput(RegexConstraint("(?<=a)b")),
    ]
    for structured in cases:
        verdict = judge(structured, True)
        assert verdict.error is not None, structured
        code, reason, field, description = verdict.error
        assert code == "INVALID_ARGUMENT" and reason and field.startswith("structured_output.")
        assert len(description) <= 400 and "Traceback" not in description


async def test_a_timeout_is_remembered_only_briefly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout may be the machine's load: its verdict expires, and the constraint is checked
    again (a crash verdict, tested above, stays)."""
    from gengate.constraints import sandbox as sandbox_module

    good = StructuredOutput(RegexConstraint("[a-z]+"))
    for memory_s in (60.0, -1.0):  # -1: as if the 60 s had already passed
        monkeypatch.setattr(sandbox_module, "TIMEOUT_MEMORY_S", memory_s)
        box = await frozen(RequestLimits(constraint_check_timeout_s=0.2))
        try:
            with pytest.raises(errors.InvalidArgument):
                await box.check(good, trial_compile=True)  # the stopped checker times out
            if memory_s > 0:
                with pytest.raises(errors.InvalidArgument):
                    await box.check(good, trial_compile=True)  # remembered: not checked again
                assert box.checks_run == 2  # the warm-up and the one that timed out
            else:
                await box.check(good, trial_compile=True)  # expired: checked again, on a fresh checker
                assert box.checks_run == 3
        finally:
            await box.aclose()
