"""The JSONSchemaBench runner, compile-only, on a few schemas of the shared sample."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "jsonschemabench.py"


def test_compile_only_counts_every_schema(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("jsonschemabench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if not any(bench.DEFAULT_CORPUS.glob("*/*.json")):
        pytest.skip("the shared JSONSchemaBench sample is not on this machine")
    assert bench.main(["--llguidance-only", "--limit", "6"]) == 0
    out = capsys.readouterr().out
    assert "6 schemas" in out
    counted = sum(
        int(line.split()[-2]) for line in out.splitlines() if line.strip().startswith(("compiled", "refused"))
    )
    assert counted == 6
