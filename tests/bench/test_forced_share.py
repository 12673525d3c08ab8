"""bench/forced_share.py end to end: every realistic document comes out byte for byte through the
decoder with jump-forward on both benchmark tokenizers, and it took fewer passes than tokens.
The counts are deterministic (greedy, no timing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # builds the 32k benchmark model when it is not cached


def test_every_document_is_replayed_exactly_in_fewer_passes() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "forced_share.py")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in done.stdout.splitlines()]
    rows = [r for r in rows if len(r) == 6 and r[2].isdigit()]
    assert len(rows) == 8  # four documents, two tokenizers
    for name, _, tokens, passes, _, exact in rows:
        assert exact == "True", name
        assert 0 < int(passes) < int(tokens), name
