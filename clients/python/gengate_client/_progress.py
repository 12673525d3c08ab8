"""Progress of a batch on stderr: tqdm when it is installed, else one self-rewriting line."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from gengate_client.types import ItemResult


class BatchProgress:
    """Counts finished and failed items of a batch of `total`."""

    def __init__(self, total: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self._stream = stream or sys.stderr
        self._bar: Any = None
        self._enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                self._write()
            else:
                self._bar = tqdm(total=total, unit="item", desc="batch", file=self._stream)

    def update(self, item: ItemResult) -> None:
        self.done += 1
        self.failed += 0 if item.ok else 1
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(failed=self.failed, refresh=False)
        else:
            self._write()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._enabled:
            self._stream.write("\n")
            self._stream.flush()

    def _write(self) -> None:
        self._stream.write(f"\rbatch: {self.done}/{self.total} done, {self.failed} failed")
        self._stream.flush()
