"""Constraint checks in sandbox processes: a hostile constraint costs its own request only.

Everything that scales with a constraint and runs library code on it — the JSON Schema metaschema
check, lowering to an llguidance grammar, a trial compile and first token mask over a byte
vocabulary — runs here, in a small pool of child processes with a memory limit (RLIMIT_AS) and
a time budget. A check over its budget is killed (it stops consuming CPU at once); a check that
crashes its process (a stack overflow in the grammar engine) or runs out of memory is refused
with INVALID_ARGUMENT for that caller; the server, the engines and other callers carry on.
Verdicts are cached by the constraint's canonical text, so repeated constraints cost nothing.
A full pool queues up to `max_pending_constraint_checks` checks, then answers
RESOURCE_EXHAUSTED with RetryInfo: a busy server never blames the caller's input.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import pickle
import resource
import struct
import sys
import time
from dataclasses import dataclass

from gengate import errors
from gengate.constraints import kinds
from gengate.domain import StructuredOutput
from gengate.limits import RequestLimits
from gengate.lru import LruCache

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
TOO_COMPLEX = "CONSTRAINT_TOO_COMPLEX"
_TOO_COMPLEX = "the constraint is too complex"
# How long a timed-out verdict is remembered (a timeout can be load, not the constraint).
TIMEOUT_MEMORY_S = 60.0
# A checker says READY once its imports are done, so start-up time never counts against a check.
READY = b"gengate-sandbox-ready\n"
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Verdict:
    """A check's answer: None when the constraint is fine, else the error to give the caller."""

    error: tuple[str, str, str, str] | None = None  # (code, reason, field, description)
    # A refusal that may say more about the machine's load than the constraint (a timeout).
    transient: bool = False

    def raise_if_refused(self) -> None:
        if self.error is None:
            return
        code, reason, field, description = self.error
        cls = errors.Unimplemented if code == "UNIMPLEMENTED" else errors.InvalidArgument
        raise cls(
            f"{field}: {description}", reason=reason, violations=[errors.FieldViolation(field, description)]
        )

    def to_json(self) -> bytes:
        return json.dumps(self.error).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Verdict:
        """Parses a child's answer as plain data (never unpickled: the child runs hostile input)."""
        value = json.loads(data)
        if value is None:
            return cls()
        code, reason, field, description = (str(v)[:1000] for v in value)
        return cls((code, reason, field, description))


class _Checker:
    """One sandbox child process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self.stdin = process.stdin
        self.stdout = process.stdout

    async def ask(self, payload: bytes, timeout_s: float) -> bytes:
        self.stdin.write(_HEADER.pack(len(payload)) + payload)
        await self.stdin.drain()
        async with asyncio.timeout(timeout_s):
            size = _HEADER.unpack(await self.stdout.readexactly(_HEADER.size))[0]
            return await self.stdout.readexactly(size)

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        with contextlib.suppress(Exception):
            await self.process.wait()


class _Crashed(Exception):
    """The checker process ended during a check (a crash, out of memory, or killed from outside)."""


class ConstraintSandbox:
    """A pool of sandbox processes that judge constraints (started lazily, replaced when killed)."""

    def __init__(self, limits: RequestLimits, *, cache_size: int = 1024) -> None:
        self.limits = limits
        self._idle: list[_Checker] = []
        self._busy: set[_Checker] = set()
        self._started = 0
        self._free = asyncio.Condition()
        self._pending = 0
        # Verdicts with the time.monotonic() they expire (inf: a definite answer).
        self._verdicts: LruCache[str, tuple[Verdict, float]] = LruCache(cache_size)
        self._inflight: dict[str, asyncio.Future[Verdict]] = {}
        self.checks_run = 0  # checks a checker process ran
        self.cache_hits = 0  # checks answered by a remembered verdict
        self.killed = 0

    @property
    def pending(self) -> int:
        """Checks running or waiting for a checker."""
        return self._pending

    @property
    def pids(self) -> list[int]:
        """Process ids of the running checkers (busy or idle)."""
        return [c.process.pid for c in self._busy | set(self._idle)]

    async def check(
        self, structured: StructuredOutput, *, trial_compile: bool, off_loop: bool = False
    ) -> None:
        """Raises the caller's error (InvalidArgument/Unimplemented) when the constraint is refused,
        ResourceExhausted when every checker is busy and the queue is full.

        `off_loop`: the constraint is large; its cache key and payload are made in a thread.
        Identical checks in flight at once share one run.
        """
        key = (
            await asyncio.to_thread(_key, structured, trial_compile)
            if off_loop
            else _key(structured, trial_compile)
        )
        cached = self._verdicts.get(key)
        if cached is not None and cached[1] > time.monotonic():
            self.cache_hits += 1
            cached[0].raise_if_refused()
            return
        work = self._inflight.get(key)
        if work is None:
            job = (structured, trial_compile)
            payload = await asyncio.to_thread(pickle.dumps, job) if off_loop else pickle.dumps(job)
            work = asyncio.ensure_future(self._run(payload, kinds.field_of(structured.constraint.kind)))
            self._inflight[key] = work
            work.add_done_callback(lambda done: self._finished(key, done))
        verdict = await asyncio.shield(work)
        verdict.raise_if_refused()

    def _finished(self, key: str, done: asyncio.Future[Verdict]) -> None:
        self._inflight.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return
        verdict = done.result()
        # A timeout may be the machine's load rather than the constraint: remembered briefly only.
        expires = time.monotonic() + TIMEOUT_MEMORY_S if verdict.transient else math.inf
        self._verdicts.put(key, (verdict, expires))

    async def _run(self, payload: bytes, field: str) -> Verdict:
        if self._pending >= self.limits.max_pending_constraint_checks + self.limits.constraint_checkers:
            raise errors.ResourceExhausted(
                "every constraint checker is busy and the queue is full; try again shortly",
                reason="CONSTRAINT_CHECKERS_BUSY",
                retry_after_s=1.0,
            )
        self._pending += 1
        try:
            budget = self.limits.constraint_check_timeout_s
            for attempt in (1, 2):
                try:
                    return await self._ask_one(payload)
                except TimeoutError:
                    return Verdict(
                        (
                            "INVALID_ARGUMENT",
                            TOO_COMPLEX,
                            field,
                            f"{_TOO_COMPLEX}: checking it took over {budget:g} s",
                        ),
                        transient=True,
                    )
                except _Crashed:
                    if attempt == 1:
                        continue  # once more on a fresh checker: the first may have died of other causes
            return Verdict(
                (
                    "INVALID_ARGUMENT",
                    TOO_COMPLEX,
                    field,
                    f"{_TOO_COMPLEX}: the grammar engine ran out of stack or memory "
                    f"({self.limits.constraint_check_memory_mb} MB) on it",
                )
            )
        finally:
            self._pending -= 1

    async def _ask_one(self, payload: bytes) -> Verdict:
        """One check on one checker; a checker that timed out or crashed is discarded."""
        checker = await self._acquire()
        self.checks_run += 1
        try:
            answer = await checker.ask(payload, self.limits.constraint_check_timeout_s)
        except TimeoutError:
            self.killed += 1
            await self._discard(checker)
            raise
        except (asyncio.IncompleteReadError, ConnectionError):
            self.killed += 1
            returncode = await _exit_code(checker)
            await self._discard(checker)
            log.warning("a constraint check ended its sandbox process (exit %s)", returncode)
            raise _Crashed from None
        except BaseException:
            await self._discard(checker)  # a cancelled check: its answer may be half read
            raise
        await self._release(checker)
        return Verdict.from_json(answer)

    async def _acquire(self) -> _Checker:
        async with self._free:
            while not self._idle and self._started >= self.limits.constraint_checkers:
                await self._free.wait()
            if self._idle:
                checker = self._idle.pop()
                self._busy.add(checker)
                return checker
            self._started += 1
        try:
            checker = await self._spawn()
        except BaseException:
            await self._forget_one()
            raise
        self._busy.add(checker)
        return checker

    async def _release(self, checker: _Checker) -> None:
        self._busy.discard(checker)
        async with self._free:
            self._idle.append(checker)
            self._free.notify()

    async def _discard(self, checker: _Checker) -> None:
        self._busy.discard(checker)
        try:
            await checker.kill()
        finally:
            await self._forget_one()

    async def _forget_one(self) -> None:
        """One started checker fewer (it was killed, or never came up); wakes a waiter."""
        self._started -= 1
        async with self._free:
            self._free.notify()

    async def _spawn(self) -> _Checker:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            # Imported by name, not run as __main__: the module must be the same on both sides.
            f"from gengate.constraints.sandbox import serve; serve({self.limits.constraint_check_memory_mb})",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            limit=2**26,
        )
        checker = _Checker(process)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                ready = await checker.stdout.readexactly(len(READY))
        except (TimeoutError, asyncio.IncompleteReadError):
            ready = b""
        except BaseException:
            await checker.kill()  # a caller cancelled while its checker was starting
            raise
        if ready != READY:  # the server's own trouble (no memory, a broken install): never the caller's
            await checker.kill()
            raise errors.Unavailable(
                "could not start a constraint checker process", reason="CONSTRAINT_CHECKER_UNAVAILABLE"
            )
        return checker

    async def aclose(self) -> None:
        async with self._free:
            idle, self._idle = self._idle, []
        for checker in idle + list(self._busy):
            await checker.kill()


def _key(structured: StructuredOutput, trial_compile: bool) -> str:
    """The cache key of a check."""
    from gengate.constraints.compiler import constraint_key

    return f"{int(trial_compile)}:{constraint_key(structured)}"


async def _exit_code(checker: _Checker) -> int | None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.0):
            return await checker.process.wait()
    return None


# ---- the child process -----------------------------------------------------------------------


def judge(structured: StructuredOutput, trial_compile: bool) -> Verdict:
    """The whole check, in this process: syntax and metaschema, lowering, optionally a trial
    compile over a byte vocabulary. Any exception is the caller's input problem, said briefly."""
    field = kinds.field_of(structured.constraint.kind)
    try:
        kinds.check_constraint_syntax(structured)
        if trial_compile:
            _trial_compile(structured)
    except errors.GengateError as exc:
        violation = exc.violations[0] if exc.violations else errors.FieldViolation(field, exc.message)
        return Verdict((exc.code.value, exc.reason, violation.field, violation.description))
    except RecursionError:
        return Verdict(("INVALID_ARGUMENT", TOO_COMPLEX, field, "the constraint is nested too deeply"))
    except MemoryError:
        return Verdict(
            ("INVALID_ARGUMENT", TOO_COMPLEX, field, "the constraint needs too much memory to compile")
        )
    except Exception as exc:  # library errors on hostile input: say what, not the library's state
        return Verdict(
            (
                "INVALID_ARGUMENT",
                "INVALID_CONSTRAINT",
                field,
                f"cannot be read: {errors.brief(str(exc))}",
            )
        )
    return Verdict()


def _trial_compile(structured: StructuredOutput) -> None:
    """Lowers (what the syntax check checked is not checked again) and compiles over bytes."""
    from llguidance import LLMatcher

    from gengate.constraints.validation import byte_tokenizer, quiet_limits

    lowered = kinds.lower(structured, syntax_checked=True)
    matcher = LLMatcher(byte_tokenizer(), lowered.grammar, log_level=0, limits=quiet_limits())
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise errors.InvalidArgument.field(
            kinds.field_of(lowered.kind),
            f"not supported by the grammar engine: {errors.brief(matcher.get_error())}",
            reason="INVALID_CONSTRAINT",
        )


def sandbox_warmup() -> None:
    """Imports and builds once what every check needs (before READY, not inside a check's budget):
    the specs' modules are imported with this one."""
    from gengate.constraints.validation import byte_tokenizer

    byte_tokenizer()


def serve(memory_mb: int) -> None:
    """Answers checks from stdin on stdout until stdin closes."""
    limit = memory_mb * 1024 * 1024
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    stdin = sys.stdin.buffer
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # nothing else, Python or native code, may write into the answer pipe
    sys.stdout = sys.stderr
    sandbox_warmup()
    stdout.write(READY)
    stdout.flush()

    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        structured, trial_compile = pickle.loads(stdin.read(_HEADER.unpack(header)[0]))
        answer = judge(structured, trial_compile).to_json()
        stdout.write(_HEADER.pack(len(answer)) + answer)
        stdout.flush()
