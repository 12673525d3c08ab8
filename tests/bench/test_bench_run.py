"""bench/run --quick end to end, without the benchmark's own venv (.venv-bench): the sections
that need no LiteLLM run and write results.json and results.md of the documented shape, the
gateway section says its LiteLLM peer was skipped and why, and gengate's schema outputs all
validate. No timings are asserted: the numbers are the benchmark's business."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ["gateway", "gguf", "constraints", "compile"]

pytestmark = pytest.mark.slow  # ~40-60 s on the 2-core machine: four servers and two models


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("bench-run")
    env = {**os.environ, "GENGATE_BENCH_VENV": str(out / "no-such-venv")}
    done = subprocess.run(
        [str(REPO / "bench" / "run"), "--quick", "--only", ",".join(SECTIONS), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text(), out


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_machine_and_sections_are_recorded(results: tuple[dict[str, Any], str, Path]) -> None:
    data, _, _ = results
    assert data["mode"] == "quick"
    machine = data["machine"]
    assert machine["cores"] >= 1 and machine["cpu"]
    assert len(machine["load_average_start"]) == 3 and len(machine["load_average_end"]) == 3
    assert machine["packages"]["grpcio"] and machine["packages"]["llama_cpp_python"]
    assert machine["packages"]["litellm (bench venv)"] is None
    assert list(data["sections"]) == SECTIONS
    for name, section in data["sections"].items():
        assert section["status"] == "ok", (name, section["status"])
        assert section["rows"] and section["ratios"], name
        assert all(_positive(v) for v in section["ratios"].values()), (name, section["ratios"])


def test_gateway_without_the_bench_venv_says_litellm_was_skipped(
    results: tuple[dict[str, Any], str, Path],
) -> None:
    data, markdown, _ = results
    gateway = data["sections"]["gateway"]
    assert gateway["litellm"] == "skipped: run bench/setup-peers"
    assert "LiteLLM proxy: skipped: run bench/setup-peers" in markdown
    combos = {(r["variant"], r["mode"], r["concurrency"]) for r in gateway["rows"]}
    assert combos == {(v, m, c) for v in ("direct", "gengate") for m in ("unary", "stream") for c in (1, 32)}
    for r in gateway["rows"]:
        assert r["requests"] > 0 and _positive(r["req_s"]) and _positive(r["req_s_ratio"])
        assert _positive(r["p50_ms"]) and r["p99_ms"] >= r["p50_ms"]
        if r["variant"] == "direct":
            assert r["added_p50_ms"] == 0 and r["req_s_ratio"] == 1
    assert set(gateway["ratios"]) == {
        f"gengate {m} c={c} req/s ÷ direct" for m in ("unary", "stream") for c in (1, 32)
    }


def test_gguf_counts_schema_outputs_and_gengate_is_always_valid(
    results: tuple[dict[str, Any], str, Path],
) -> None:
    data, _, _ = results
    rows = {(r["output"], r["variant"]): r for r in data["sections"]["gguf"]["rows"]}
    assert set(rows) == {(o, v) for o in ("plain", "json_schema") for v in ("gengate", "llama-cpp-python")}
    for r in rows.values():
        assert r["requests"] > 0 and _positive(r["tok_s"]) and _positive(r["p50_ms"])
    # EOS masked on both sides: the plain runs make the same number of tokens.
    assert rows[("plain", "gengate")]["tokens"] == rows[("plain", "llama-cpp-python")]["tokens"]
    ours = rows[("json_schema", "gengate")]
    assert ours["valid"] == ours["answered"] == ours["requests"] and ours["refused"] == 0
    peer = rows[("json_schema", "llama-cpp-python")]
    assert 0 <= peer["valid"] <= peer["answered"] + peer["refused"] == peer["requests"]


def test_constraints_and_compile_cover_both_models(results: tuple[dict[str, Any], str, Path]) -> None:
    data, _, _ = results
    ratios = data["sections"]["constraints"]["ratios"]
    assert set(ratios) == {
        f"{which} ÷ unconstrained tok/s, {m}"
        for m in ("tiny", "32k")
        for which in ("constrained", "mostly forced schema")
    }
    compiled = {r["model"]: r for r in data["sections"]["compile"]["rows"]}
    assert set(compiled) == {"tiny", "32k"}
    for r in compiled.values():
        # each schema: one cold compile (a miss), then the same and an annotation-only change (hits)
        assert r["misses"] == r["compiles"] and r["hits"] == 2 * r["compiles"]
        assert all(_positive(r[k]) for k in ("cold_ms", "cached_ms", "annotation_only_ms"))


def test_markdown_puts_ratios_first(results: tuple[dict[str, Any], str, Path]) -> None:
    data, markdown, out = results
    headings = [line for line in markdown.splitlines() if line.startswith("## ")]
    assert headings == ["## Ratios", *(f"## {name}" for name in SECTIONS)]
    for section in data["sections"].values():
        for name in section["ratios"]:
            assert f"| {name} |" in markdown
    if data["plots"].startswith("made by"):  # only where this python has matplotlib
        assert sorted(p.name for p in out.glob("*.png")) == sorted(f"{n}.png" for n in SECTIONS)
    else:
        assert data["plots"].startswith("skipped: run bench/setup-peers")
