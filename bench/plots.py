"""bench/run's plots: one PNG per section from a results folder's results.json (matplotlib, Agg).

Runs under whichever python has matplotlib (.venv-bench from bench/setup-peers), so it needs
nothing but matplotlib and the standard library.

    .venv-bench/bin/python bench/plots.py bench/results/<run>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _bars(ax: Any, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    """Grouped bars: one group per label, one bar per series."""
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + k * width for i in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)


def gateway(section: dict[str, Any], title: str) -> Any:
    rows = section["rows"]
    groups = sorted({(r["mode"], r["concurrency"]) for r in rows}, key=lambda g: (g[0] != "unary", g[1]))
    labels = [f"{m} c={c}" for m, c in groups]
    variants = [v for v in ("gengate", "litellm") if any(r["variant"] == v for r in rows)]

    def pick(key: str, variant: str) -> list[float]:
        found = {(r["mode"], r["concurrency"]): r[key] for r in rows if r["variant"] == variant}
        return [found.get(g, 0.0) for g in groups]

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    _bars(left, labels, {v: pick("added_p50_ms", v) for v in variants}, "ms (log)", "added p50 over direct")
    left.set_yscale("symlog", linthresh=1.0)  # c=1 adds ms, c=32 hundreds: both readable
    _bars(right, labels, {v: pick("req_s_ratio", v) for v in variants}, "÷ direct", "req/s ÷ direct")
    right.axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle(title)
    return fig


def gguf(section: dict[str, Any], title: str) -> Any:
    rows = section["rows"]
    outputs = ["plain", "json_schema"]
    variants = sorted({r["variant"] for r in rows})
    found = {(r["output"], r["variant"]): r for r in rows}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    tok = {v: [found[(o, v)]["tok_s"] if (o, v) in found else 0.0 for o in outputs] for v in variants}
    _bars(left, outputs, tok, "tok/s", "tok/s (higher is better)")
    valid = {
        v: [100 * found[("json_schema", v)].get("valid", 0) / max(found[("json_schema", v)]["requests"], 1)]
        for v in variants
        if ("json_schema", v) in found
    }
    _bars(right, ["JSON Schema outputs"], valid, "% valid against the schema", "outputs valid")
    fig.suptitle(title)
    return fig


def constraints(section: dict[str, Any], title: str) -> Any:
    rows = [r for r in section["rows"] if r.get("ratio") is not None]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    series = {"constrained ÷ unconstrained": [r["ratio"] for r in rows]}
    _bars(ax, [r["model"] for r in rows], series, "ratio", "tok/s")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle(title)
    return fig


def compile_times(section: dict[str, Any], title: str) -> Any:
    rows = section["rows"]
    series = {
        "cold": [r["cold_ms"] for r in rows],
        "cached": [r["cached_ms"] for r in rows],
        "annotation-only change": [r["annotation_only_ms"] for r in rows],
    }
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _bars(ax, [r["model"] for r in rows], series, "ms (log)", "JSON Schema compile (median)")
    ax.set_yscale("log")
    fig.suptitle(title)
    return fig


PLOTS = {"gateway": gateway, "gguf": gguf, "constraints": constraints, "compile": compile_times}


def main(folder: str) -> int:
    out = Path(folder)
    results = json.loads((out / "results.json").read_text())
    when = f"{results['started']} · {results['machine']['cpu']} · {results['machine']['cores']} cores"
    for name, section in results["sections"].items():
        if name in PLOTS and section.get("rows"):
            fig = PLOTS[name](section, f"{name} — {when}")
            fig.tight_layout()
            fig.savefig(out / f"{name}.png", dpi=110)
            plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
