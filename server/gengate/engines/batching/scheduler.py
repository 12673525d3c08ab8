"""Continuous batching shared by the batched local engines (transformers, MLX): one thread owns
the model and steps every active sequence together in one forward pass.

The loop here is the engine-neutral part: admission up to `max_batch_size`, deadlines, cancels,
handing each row's logits to its SequenceDecoder, and ending sequences. How rows are run through
the model and how their KV cache joins, decodes and drops rows is the engine's `ModelBatch`
(engines/transformers/batch.py, engines/mlx/batch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from gengate.domain import FinishReason

log = logging.getLogger(__name__)

Logits = npt.NDArray[np.float32]


class StepDecoder(Protocol):
    """Turns one row of logits into the next token (sampling, constraints, stop strings); tokens
    the constraint forces need none (SequenceDecoder.forced_steps, for jump-forward)."""

    def step(self, logits: Logits) -> Any: ...

    def forced_steps(self, limit: int, going: Callable[[], bool]) -> Iterator[Any]: ...


@dataclass(frozen=True)
class Admitted:
    """The sequence joined the batch at `at` (time.monotonic())."""

    at: float


@dataclass(frozen=True)
class Stepped:
    """One decoded token; `result` is the decoder's StepResult."""

    result: Any
    at: float


@dataclass(frozen=True)
class Ended:
    """The scheduler ended the sequence itself (deadline, context full, shutdown)."""

    reason: FinishReason


@dataclass(frozen=True)
class Failed:
    error: BaseException


SequenceEvent = Admitted | Stepped | Ended | Failed


@dataclass(eq=False)
class Sequence:
    """One generation in flight. Events go to `sink`, which must be thread-safe."""

    prompt_ids: list[int]
    decoder: StepDecoder
    sink: Callable[[Sequence, SequenceEvent], None]
    max_total_tokens: int
    deadline: float | None = None
    tokens: list[int] = field(default_factory=list)
    unfed: int = 0  # the last tokens the model has not seen: the next decode feeds them
    cancelled: bool = False

    def cancel(self) -> None:
        """Asks the scheduler to drop this sequence at its next step."""
        self.cancelled = True

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_ids + self.tokens


def asyncio_sink(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[Sequence, SequenceEvent]]
) -> Callable[[Sequence, SequenceEvent], None]:
    """A sink that hands events from the model thread to an asyncio queue."""

    def push(seq: Sequence, event: SequenceEvent) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (seq, event))
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            seq.cancel()

    return push


@dataclass
class SchedulerStats:
    """Counters proving (or disproving) batching; read them from any thread."""

    forward_passes: int = 0
    prefill_passes: int = 0
    decode_passes: int = 0
    rebuilds: int = 0
    tokens_generated: int = 0
    max_batch_size: int = 0
    active: int = 0
    waiting: int = 0


class ModelBatch(Protocol):
    """An engine's side of the batch: the model and the KV cache of the active rows.

    Rows are in the scheduler's order: `join` appends `joining` after `active`, `keep` selects
    rows. Both return-logit methods give one float32 row of next-token logits per active row.
    `feeds_runs`: decode can feed several tokens (`Sequence.unfed`, the same for every row), so
    the tokens a constraint forces join the pass of the token before them; else one a pass."""

    stats: SchedulerStats
    feeds_runs: bool

    def join(self, active: list[Sequence], joining: list[Sequence]) -> Logits:
        """Adds `joining` after `active`; logits for every row (active first: their next step)."""
        ...

    def decode(self, active: list[Sequence]) -> Logits:
        """Feeds every row its last `unfed` tokens."""
        ...

    def keep(self, rows: list[int], active: list[Sequence]) -> None:
        """Keeps only `rows` (indices into the batch before); `active` is what remains."""
        ...

    def reset(self) -> None:
        """Drops the cache (no rows left, or a failed step)."""
        ...

    def running(self) -> AbstractContextManager[Any]:
        """Context the model thread steps in (torch.inference_mode, an MLX stream)."""
        ...


def no_context() -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


# Tokens a row alone takes into one pass at most (a sampled one and those forced after it).
MAX_RUN = 32


def _going(seq: Sequence) -> bool:
    return not seq.cancelled and (seq.deadline is None or time.monotonic() <= seq.deadline)


class BatchScheduler:
    """Owns the model on one thread; sequences are submitted from any thread."""

    def __init__(self, batch: ModelBatch, *, max_batch_size: int, engine: str) -> None:
        self.batch = batch
        self.max_batch_size = max_batch_size
        self.engine = engine
        self.stats = batch.stats
        self._waiting: deque[Sequence] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._active: list[Sequence] = []
        self._jumps = batch.feeds_runs
        self._thread = threading.Thread(target=self._run, name=f"gengate-{engine}", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("scheduler is stopped")
            self._waiting.append(seq)
            self.stats.waiting = len(self._waiting)
            self._cv.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the thread; sequences still waiting or active end with Failed."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            with self.batch.running():
                self._loop()
        finally:
            with self._cv:
                self._stopping = True  # a thread that died takes no more work: submit() refuses it
                pending = list(self._waiting) + self._active
                self._waiting.clear()
            from gengate.errors import Unavailable

            for seq in pending:
                seq.sink(seq, Failed(Unavailable(f"the {self.engine} engine is shutting down")))
            self._reset()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._active:
                    self._cv.wait()
                if self._stopping:
                    return
                joining: list[Sequence] = []
                room = self.max_batch_size - len(self._active)
                while self._waiting and len(joining) < room:
                    seq = self._waiting.popleft()
                    if not seq.cancelled:
                        joining.append(seq)
                self.stats.waiting = len(self._waiting)
            try:
                self._iteration(joining)
            except Exception as exc:  # a failed forward fails the batch, not the thread
                log.exception("batch step failed")
                for seq in self._active + [s for s in joining if s not in self._active]:
                    seq.sink(seq, Failed(exc))
                self._reset()

    def _reset(self) -> None:
        self._active = []
        self.batch.reset()
        self.stats.active = 0

    def _iteration(self, joining: list[Sequence]) -> None:
        now = time.monotonic()
        for seq in self._active:
            if not seq.cancelled and seq.deadline is not None and now > seq.deadline:
                seq.sink(seq, Ended(FinishReason.TIME_LIMIT))
                seq.cancel()
        self._keep([i for i, s in enumerate(self._active) if not s.cancelled])
        for seq in joining:
            seq.sink(seq, Admitted(now))
        held: list[tuple[Sequence, Any]] = []
        joining = self._leads(joining, now, held)
        if joining:
            logits = self.batch.join(self._active, joining)
            self._active = self._active + joining
        elif self._active:
            logits = self.batch.decode(self._active)
        else:
            for seq, result in held:  # (every joining row was forced to its end)
                seq.sink(seq, Stepped(result, now))
            return
        batch = len(self._active)
        self.stats.max_batch_size = max(self.stats.max_batch_size, batch)
        self.stats.active = batch
        at = time.monotonic()
        for seq, result in held:
            seq.sink(seq, Stepped(result, at))
        keep: list[int] = []
        for i, seq in enumerate(self._active):
            if seq.cancelled:
                continue
            try:
                finished = self._step(seq, logits[i], at)
            except Exception as exc:
                log.exception("decoder step failed")
                seq.sink(seq, Failed(exc))
                continue
            if finished:
                continue
            if seq.length >= seq.max_total_tokens:
                seq.sink(seq, Ended(FinishReason.LENGTH))
                continue
            keep.append(i)
        self._keep(keep)

    def _leads(self, joining: list[Sequence], at: float, held: list[tuple[Sequence, Any]]) -> list[Sequence]:
        """Takes the tokens each joining row's constraint forces before its first sampled one:
        they join its prefill, and are told after it (with the first sampled token, as on
        llama.cpp) from `held`. The rows still to prefill: not those forced to their end, nor
        one whose decoder failed."""
        rows = []
        for seq in joining:
            taken: list[tuple[Sequence, Any]] = []
            try:
                finished = self._take_forced(seq, at, taken)
            except Exception as exc:
                log.exception("decoder step failed")
                for _, result in taken:
                    seq.sink(seq, Stepped(result, at))
                seq.sink(seq, Failed(exc))
                continue
            held += taken
            if not finished:
                rows.append(seq)
        return rows

    def _step(self, seq: Sequence, logits: Logits, at: float) -> bool:
        """Steps `seq` on its logits, then takes the tokens its constraint forces after that
        one, if the batch can feed them with it in the next pass; whether `seq` finished."""
        result = seq.decoder.step(logits)
        seq.unfed = 0
        if self._took(seq, result, at):
            return True
        if not self._jumps or len(self._active) > 1:
            return False  # (a run would widen every row's pass with padding: bench/README.md)
        return self._take_forced(seq, at)

    def _take_forced(self, seq: Sequence, at: float, held: list[tuple[Sequence, Any]] | None = None) -> bool:
        """Takes the tokens `seq`'s constraint forces next (at most MAX_RUN fed at once; a
        cancel or the deadline stops them), told now or kept in `held`; whether one of them
        finished `seq`."""
        room = min(MAX_RUN - seq.unfed, seq.max_total_tokens - seq.length)
        for result in seq.decoder.forced_steps(room, lambda: _going(seq)):
            if self._took(seq, result, at, held):
                return True
        return False  # (a cancel or the deadline: the next iteration ends it)

    def _took(
        self, seq: Sequence, result: Any, at: float, held: list[tuple[Sequence, Any]] | None = None
    ) -> bool:
        """Records a step's token (not fed yet) and tells the sink, or keeps it in `held`;
        whether it finished `seq`."""
        if result.token_id is not None:
            seq.tokens.append(int(result.token_id))
            seq.unfed += 1
            self.stats.tokens_generated += 1
        if held is None:
            seq.sink(seq, Stepped(result, at))
        else:
            held.append((seq, result))
        return result.finished is not None

    def _keep(self, rows: list[int]) -> None:
        """Keeps only `rows` of the batch, in order."""
        if len(rows) == len(self._active):
            return
        self._active = [self._active[i] for i in rows]
        self.stats.active = len(self._active)
        if not self._active:
            self.batch.reset()
            return
        self.batch.keep(rows, self._active)
