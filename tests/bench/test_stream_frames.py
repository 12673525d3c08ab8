"""bench/stream_frames.py --quick end to end, with --base pointing at this same checkout: both
servers come up and every model and concurrency has a row for each, with frames per stream.
No timings are asserted: the numbers are the benchmark's business."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # two servers, each with the tiny model in a worker process


def test_quick_run_with_a_base_checkout_prints_a_row_per_variant() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "stream_frames.py"), "--quick", "--base", str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("this ", "before "))]
    seen = {(r[0], r[1], r[2]) for r in rows}
    assert seen == {(v, m, c) for v in ("this", "before") for m in ("echo", "tiny") for c in ("1", "8")}
    for row in rows:
        assert float(row[5]) >= 3  # frames a stream: a start, at least one delta, an end
