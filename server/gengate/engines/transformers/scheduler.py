"""Continuous batching for a transformers causal LM: one thread owns the model and steps every
active sequence together in one forward pass.

Batch layout: the active sequences form one left-padded batch with an attention mask, explicit
per-row position ids and one DynamicCache. Between steps, finished or cancelled rows leave by
selecting the remaining rows of the cache (`batch_select_indices`); waiting sequences join by
prefilling them as their own left-padded batch and concatenating their cache to the running
one (keys/values left-padded to a common length, masked out). Where the cache has a layer type
whose tensors cannot be merged or selected that simply, the whole batch is re-prefilled from
each row's tokens instead: slower, equally correct. Padding only adds masked positions, so a
row's logits match a solo run up to float noise.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from gengate.domain import FinishReason

log = logging.getLogger(__name__)


class StepOutcome(Protocol):
    """What a per-sequence decoder returns for one step (gengate.engines.decoding.StepResult)."""

    token_id: int
    finished: FinishReason | None


class StepDecoder(Protocol):
    """Turns one row of logits into the next token (sampling, constraints, stop strings)."""

    def step(self, logits: npt.NDArray[np.float32]) -> Any: ...


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
    cancelled: bool = False

    def cancel(self) -> None:
        """Asks the scheduler to drop this sequence at its next step."""
        self.cancelled = True

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)


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


class BatchScheduler:
    """Owns the model on one thread; sequences are submitted from any thread."""

    def __init__(self, model: Any, *, max_batch_size: int, pad_token_id: int, device: str) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.stats = SchedulerStats()
        self._waiting: deque[Sequence] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._active: list[Sequence] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._keep_last_logits = True
        self._thread = threading.Thread(target=self._run, name="gengate-transformers", daemon=True)
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
            while True:
                with self._cv:
                    while not self._stopping and not self._waiting and not self._active:
                        self._cv.wait()
                    if self._stopping:
                        break
                    joining: list[Sequence] = []
                    room = self.max_batch_size - len(self._active)
                    while self._waiting and len(joining) < room:
                        seq = self._waiting.popleft()
                        if not seq.cancelled:
                            joining.append(seq)
                    self.stats.waiting = len(self._waiting)
                try:
                    with torch.inference_mode():
                        self._iteration(joining)
                except Exception as exc:  # a failed forward fails the batch, not the thread
                    log.exception("batch step failed")
                    for seq in self._active + [s for s in joining if s not in self._active]:
                        seq.sink(seq, Failed(exc))
                    self._reset()
        finally:
            with self._cv:
                pending = list(self._waiting) + self._active
                self._waiting.clear()
            from gengate.errors import Unavailable

            for seq in pending:
                seq.sink(seq, Failed(Unavailable("the transformers engine is shutting down")))
            self._reset()

    def _reset(self) -> None:
        self._active, self._cache, self._mask = [], None, None
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
        if joining:
            logits = self._join(joining)
        elif self._active:
            logits = self._decode()
        else:
            return
        batch = len(self._active)
        self.stats.max_batch_size = max(self.stats.max_batch_size, batch)
        self.stats.active = batch
        rows = logits.float().cpu().numpy()
        at = time.monotonic()
        keep: list[int] = []
        for i, seq in enumerate(self._active):
            if seq.cancelled:
                continue
            try:
                result = seq.decoder.step(rows[i])
            except Exception as exc:
                log.exception("decoder step failed")
                seq.sink(seq, Failed(exc))
                continue
            if result.token_id is not None:
                seq.tokens.append(int(result.token_id))
                self.stats.tokens_generated += 1
            seq.sink(seq, Stepped(result, at))
            if result.finished is not None:
                continue
            if seq.length >= seq.max_total_tokens:
                seq.sink(seq, Ended(FinishReason.LENGTH))
                continue
            keep.append(i)
        self._keep(keep)

    def _keep(self, rows: list[int]) -> None:
        """Keeps only `rows` of the batch, in order."""
        if len(rows) == len(self._active):
            return
        self._active = [self._active[i] for i in rows]
        self.stats.active = len(self._active)
        if not self._active:
            self._cache, self._mask = None, None
            return
        assert self._mask is not None
        index = torch.tensor(rows, device=self.device)
        try:
            self._cache.batch_select_indices(index)
        except Exception:  # a cache type that cannot select rows: rebuild on the next step
            self._cache = None
        self._mask = self._mask.index_select(0, index)
        # Columns that are padding in every remaining row only cost time: drop them.
        used = (self._mask.sum(dim=0) > 0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first > 0 and self._cache is not None and _plain_layers(self._cache):
            self._mask = self._mask[:, first:]
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, first:]
                layer.values = layer.values[:, :, first:]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        self.stats.forward_passes += 1
        args = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": positions,
            "past_key_values": cache,
            "use_cache": True,
        }
        if self._keep_last_logits:
            try:
                return self.model(**args, logits_to_keep=1)
            except TypeError as exc:  # remote-code models that predate `logits_to_keep`
                if "logits_to_keep" not in str(exc):
                    raise
                self._keep_last_logits = False
        return self.model(**args)

    def _prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Runs every token of `seqs` (prompt + generated) as one left-padded batch."""
        from transformers import DynamicCache

        width = max(s.length for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        positions = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            tokens = seq.prompt_ids + seq.tokens
            ids[row, width - len(tokens) :] = torch.tensor(tokens)
            mask[row, width - len(tokens) :] = 1
            positions[row, width - len(tokens) :] = torch.arange(len(tokens))
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        cache = DynamicCache(config=self.model.config)
        out = self._forward(ids, mask, positions, cache)
        self.stats.prefill_passes += 1
        return out.logits[:, -1, :], mask, out.past_key_values

    def _join(self, joining: list[Sequence]) -> torch.Tensor:
        """Adds `joining` to the batch; returns next-token logits for every active row."""
        if not self._active or self._cache is None or not _plain_layers(self._cache):
            self.stats.rebuilds += int(bool(self._active))
            seqs = self._active + joining
            logits, self._mask, self._cache = self._prefill(seqs)
            self._active = seqs
            return logits
        old_logits = self._decode()
        new_logits, new_mask, new_cache = self._prefill(joining)
        if not _plain_layers(new_cache) or len(new_cache.layers) != len(self._cache.layers):
            # Cannot merge: fall back to one prefill of everything.
            self.stats.rebuilds += 1
            seqs = self._active + joining
            logits, self._mask, self._cache = self._prefill(seqs)
            self._active = seqs
            return logits
        assert self._mask is not None
        width = max(self._mask.shape[1], new_mask.shape[1])
        self._mask = torch.cat([_pad_left(self._mask, width, 1), _pad_left(new_mask, width, 1)], dim=0)
        for old, new in zip(self._cache.layers, new_cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width, 2), _pad_left(new.keys, width, 2)], dim=0)
            old.values = torch.cat([_pad_left(old.values, width, 2), _pad_left(new.values, width, 2)], dim=0)
        self._active = self._active + joining
        return torch.cat([old_logits, new_logits], dim=0)

    def _decode(self) -> torch.Tensor:
        """Feeds each active row its last token; returns next-token logits per row."""
        assert self._mask is not None
        if self._cache is None:  # lost by a row selection the cache could not do
            logits, self._mask, self._cache = self._prefill(self._active)
            self.stats.rebuilds += 1
            return logits
        batch = len(self._active)
        ids = torch.tensor([[s.tokens[-1]] for s in self._active], device=self.device)
        positions = torch.tensor([[s.length - 1] for s in self._active], device=self.device)
        ones = torch.ones((batch, 1), dtype=self._mask.dtype, device=self.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        out = self._forward(ids, self._mask, positions, self._cache)
        self._cache = out.past_key_values
        self.stats.decode_passes += 1
        return out.logits[:, -1, :]  # type: ignore[no-any-return]


def _plain_layers(cache: Any) -> bool:
    """True when every cache layer is a plain DynamicLayer holding (batch, heads, time, dim) tensors."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    return all(type(layer) is DynamicLayer and getattr(layer, "keys", None) is not None for layer in layers)


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Left-pads `tensor` with zeros along `dim` to `width`."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
