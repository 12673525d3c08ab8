"""TorchBatch: the transformers side of continuous batching (engines/batching/scheduler.py).

Batch layout: the active sequences form one left-padded batch with an attention mask, explicit
per-row position ids and one DynamicCache. Finished or cancelled rows leave by selecting the
remaining rows of the cache (`batch_select_indices`); waiting sequences join by prefilling them
as their own left-padded batch and concatenating their cache to the running one (keys/values
left-padded to a common length, masked out). Where the cache has a layer type whose tensors
cannot be merged or selected that simply, the whole batch is re-prefilled from each row's tokens
instead: slower, equally correct. Padding only adds masked positions, so a row's logits match a
solo run up to float noise. A decode feeds each row its unfed tokens: one, or, for a row alone,
a sampled token and those its constraint forced after it (jump-forward).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from gengate.engines.batching.scheduler import Logits, SchedulerStats, Sequence


class TorchBatch:
    """The model and the DynamicCache + attention mask of the active rows."""

    def __init__(self, model: Any, *, pad_token_id: int, device: str) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.stats = SchedulerStats()
        self.feeds_runs = True  # a row alone is fed a sampled token and those forced after it at once
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._keep_last_logits = True

    def running(self) -> AbstractContextManager[Any]:
        return torch.inference_mode()

    def reset(self) -> None:
        self._cache, self._mask = None, None

    def join(self, active: list[Sequence], joining: list[Sequence]) -> Logits:
        if not active or self._cache is None or not _plain_layers(self._cache):
            self.stats.rebuilds += int(bool(active))
            return self._rebuild(active + joining)
        old_logits = self._decode_rows(active)
        new_logits, new_mask, new_cache = self._prefill(joining)
        if not _plain_layers(new_cache) or len(new_cache.layers) != len(self._cache.layers):
            # Cannot merge: fall back to one prefill of everything.
            self.stats.rebuilds += 1
            return self._rebuild(active + joining)
        assert self._mask is not None
        width = max(self._mask.shape[1], new_mask.shape[1])
        self._mask = torch.cat([_pad_left(self._mask, width, 1), _pad_left(new_mask, width, 1)], dim=0)
        for old, new in zip(self._cache.layers, new_cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width, 2), _pad_left(new.keys, width, 2)], dim=0)
            old.values = torch.cat([_pad_left(old.values, width, 2), _pad_left(new.values, width, 2)], dim=0)
        return _rows(torch.cat([old_logits, new_logits], dim=0))

    def decode(self, active: list[Sequence]) -> Logits:
        return _rows(self._decode_rows(active))

    def keep(self, rows: list[int], active: list[Sequence]) -> None:
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

    def _rebuild(self, seqs: list[Sequence]) -> Logits:
        logits, self._mask, self._cache = self._prefill(seqs)
        return _rows(logits)

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
            tokens = seq.all_tokens
            ids[row, width - len(tokens) :] = torch.tensor(tokens)
            mask[row, width - len(tokens) :] = 1
            positions[row, width - len(tokens) :] = torch.arange(len(tokens))
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        cache = DynamicCache(config=self.model.config)
        out = self._forward(ids, mask, positions, cache)
        self.stats.prefill_passes += 1
        return out.logits[:, -1, :], mask, out.past_key_values

    def _decode_rows(self, active: list[Sequence]) -> torch.Tensor:
        """Feeds each active row its `unfed` last tokens; next-token logits per row."""
        if self._cache is None:  # lost by a row selection the cache could not do
            logits, self._mask, self._cache = self._prefill(active)
            self.stats.rebuilds += 1
            return logits
        assert self._mask is not None
        n = active[0].unfed  # (the same for every row: only a row alone takes a forced run)
        ids = torch.tensor([s.tokens[-n:] for s in active], device=self.device)
        positions = torch.tensor([list(range(s.length - n, s.length)) for s in active], device=self.device)
        fed = torch.ones((len(active), n), dtype=self._mask.dtype, device=self.device)
        self._mask = torch.cat([self._mask, fed], dim=1)
        out = self._forward(ids, self._mask, positions, self._cache)
        self._cache = out.past_key_values
        self.stats.decode_passes += 1
        return out.logits[:, -1, :]  # type: ignore[no-any-return]


def _rows(logits: torch.Tensor) -> Logits:
    return logits.float().cpu().numpy()


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
