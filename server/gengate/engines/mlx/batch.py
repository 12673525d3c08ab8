"""MlxBatch: the MLX side of continuous batching (engines/batching/scheduler.py).

Each joining sequence is prefilled alone into its own mlx-lm prompt cache (in chunks, so a long
prompt never builds one huge activation), then merged into the running batch's left-padded
`BatchKVCache`s (mlx-lm's own batch cache: per-row offsets for RoPE, a mask over the padding),
so every decode step is one forward pass over all active rows. Rows leave by `filter`. A model
whose cache layers mlx-lm cannot batch (no `merge`) runs each row alone with its own cache:
correct, no shared passes. MLX evaluates lazily; logits are materialized once per step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx
import numpy as np

from gengate.engines.batching.scheduler import Logits, SchedulerStats, Sequence

PREFILL_CHUNK = 512  # prompt tokens per prefill pass
CLEAR_EVERY = 256  # decode passes between releases of MLX's buffer cache


class MlxBatch:
    """The model and the KV caches of the active rows: one batch cache per layer, or one cache
    per row for a model mlx-lm cannot batch."""

    def __init__(self, model: Any) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.stats = SchedulerStats()
        # One token a row a pass: mlx-lm's batch cache pads rows on the left only, so a row fed
        # more tokens than another would need a hole inside its cache.
        self.feeds_runs = False
        self._make_cache: Any = lambda: make_prompt_cache(model)
        self.batchable = _mergeable(self._make_cache())
        self._cache: list[Any] | None = None  # per layer (batchable)
        self._rows: list[list[Any]] = []  # per row, per layer (not batchable)

    def running(self) -> AbstractContextManager[Any]:
        # MLX streams belong to the thread that made them: the model thread steps on its own.
        return mx.stream(mx.new_stream(mx.default_device()))

    def reset(self) -> None:
        self._cache, self._rows = None, []

    def join(self, active: list[Sequence], joining: list[Sequence]) -> Logits:
        old = self._decode_rows(active) if active else None
        prefilled = [self._prefill(seq) for seq in joining]
        new = mx.concatenate([logits for logits, _ in prefilled], axis=0)
        if self.batchable:
            caches = [cache for _, cache in prefilled]
            merged = [type(layers[0]).merge(list(layers)) for layers in zip(*caches, strict=True)]
            if self._cache is None:
                self._cache = merged
            else:
                for running, joined in zip(self._cache, merged, strict=True):
                    running.extend(joined)
        else:
            self._rows.extend(cache for _, cache in prefilled)
        return _rows(new if old is None else mx.concatenate([old, new], axis=0))

    def decode(self, active: list[Sequence]) -> Logits:
        return _rows(self._decode_rows(active))

    def keep(self, rows: list[int], active: list[Sequence]) -> None:
        if self.batchable:
            assert self._cache is not None
            index = mx.array(rows)
            for layer in self._cache:
                layer.filter(index)
        else:
            self._rows = [self._rows[i] for i in rows]

    def _prefill(self, seq: Sequence) -> tuple[mx.array, list[Any]]:
        """Runs `seq`'s tokens (prompt and any generated) through a fresh cache; its last logits."""
        cache = self._make_cache()
        tokens = seq.all_tokens
        logits: mx.array | None = None
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = mx.array([tokens[start : start + PREFILL_CHUNK]])
            logits = self.model(chunk, cache=cache)[:, -1, :]
            mx.eval(logits, [layer.state for layer in cache])
            self.stats.forward_passes += 1
        self.stats.prefill_passes += 1
        assert logits is not None
        return logits, cache

    def _decode_rows(self, active: list[Sequence]) -> mx.array:
        """Feeds each active row its last token; next-token logits per row."""
        self.stats.decode_passes += 1
        if self.stats.decode_passes % CLEAR_EVERY == 0:
            mx.clear_cache()
        if self.batchable:
            self.stats.forward_passes += 1
            inputs = mx.array([[seq.tokens[-1]] for seq in active])
            logits: mx.array = self.model(inputs, cache=self._cache)[:, -1, :]
            return logits
        self.stats.forward_passes += len(active)
        return mx.concatenate(
            [
                self.model(mx.array([[seq.tokens[-1]]]), cache=cache)[:, -1, :]
                for seq, cache in zip(active, self._rows, strict=True)
            ],
            axis=0,
        )


def _mergeable(cache: list[Any]) -> bool:
    """Whether mlx-lm can merge these per-layer caches into batch caches (a cache list whose
    parts cannot is not, whatever its own type says): tried on the empty caches themselves."""
    try:
        for layer in cache:
            type(layer).merge([layer])
    except Exception:  # AttributeError (no merge), ValueError ("does not yet support batching")
        return False
    return True


def _rows(logits: mx.array) -> Logits:
    return np.array(logits.astype(mx.float32))
