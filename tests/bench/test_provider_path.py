"""bench/provider_path.py --quick end to end, with --base pointing at this same checkout: both
servers come up (the "before" one from the --base folder's own server/), every mode and
concurrency has a row for each variant with the server's CPU per request, and the fast ÷ before
ratios are written. No timings are asserted: the numbers are the benchmark's business."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[openai])")

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # ~30 s on the 2-core machine: an upstream and two servers


def test_quick_run_with_a_base_checkout_writes_rows_and_ratios(tmp_path: Path) -> None:
    out = tmp_path / "provider_path.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "provider_path.py"),
            "--quick",
            "--base",
            str(REPO),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["setup"]["base"] == str(REPO)
    seen = {(r["variant"], r["mode"], r["concurrency"]) for r in result["rows"]}
    assert seen == {
        (v, m, c) for v in ("direct", "gengate", "before") for m in ("unary", "stream") for c in (1, 32)
    }
    for row in result["rows"]:
        assert row["requests"] > 0 and row["req_s"] > 0
        if row["variant"] != "direct":
            assert row["server_cpu_ms_per_request"] > 0
    assert len(result["ratios"]) == 8
    assert all(math.isfinite(value) and value > 0 for value in result["ratios"].values())
    assert "server CPU/request fast ÷ before" in done.stdout


def test_a_base_that_is_no_checkout_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "provider_path.py"), "--base", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "no server/gengate there" in done.stderr


@pytest.mark.parametrize("provider", ["anthropic", "mistral", "cohere", "gemini", "tgi"])
def test_every_provider_is_measured_against_its_own_sdk_direct(tmp_path: Path, provider: str) -> None:
    """bench/direct_peers.py: each provider's SDK calls its fake directly, unary and streamed,
    beside gengate in the same run."""
    out = tmp_path / "provider_path.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "provider_path.py"), "--quick", "--provider", provider,
         "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["variant"], r["mode"]) for r in rows} == {
        (v, m) for v in ("direct", "gengate") for m in ("unary", "stream")
    }
    for row in rows:
        assert row["requests"] > 0  # (figures are the benchmark's business: none asserted)
