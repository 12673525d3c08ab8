"""bench/run's markdown: the machine, every ratio first, then each section's table."""

from __future__ import annotations

from typing import Any

# Columns of each section's table: (row key, heading).
COLUMNS: dict[str, list[tuple[str, str]]] = {
    "gateway": [
        ("mode", "mode"),
        ("concurrency", "c"),
        ("variant", "variant"),
        ("requests", "requests"),
        ("req_s", "req/s"),
        ("req_s_ratio", "req/s ÷ direct"),
        ("p50_ms", "p50 ms"),
        ("added_p50_ms", "added p50 ms"),
        ("p99_ms", "p99 ms"),
        ("added_p99_ms", "added p99 ms"),
    ],
    "gguf": [
        ("output", "output"),
        ("variant", "variant"),
        ("requests", "requests"),
        ("tokens", "tokens"),
        ("tok_s", "tok/s"),
        ("p50_ms", "p50 ms"),
        ("valid", "valid"),
        ("refused", "refused"),
    ],
    "constraints": [
        ("model", "model"),
        ("variant", "variant"),
        ("requests", "requests"),
        ("tok_s", "tok/s"),
        ("ratio", "÷ unconstrained"),
        ("p50_ms", "p50 ms"),
        ("first_compile_ms", "first compile ms"),
    ],
    "compile": [
        ("model", "model"),
        ("compiles", "schemas"),
        ("cold_ms", "cold ms (median)"),
        ("cold_max_ms", "cold ms (max)"),
        ("cached_ms", "cached ms"),
        ("annotation_only_ms", "annotation-only change ms"),
        ("hits", "cache hits"),
        ("misses", "misses"),
    ],
}


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def table(headings: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    packages = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
    parts = [
        f"# bench/run — {results['started']} ({results['mode']}, {results['rounds']} interleaved rounds)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, load average {m['load_average_start']} at start, "
        f"{m.get('load_average_end')} at end; Python {m['python']}; gengate {m['gengate']} "
        f"({m['commit']}); {packages}. Plots: {results.get('plots', '—')}.",
        "",
        "## Ratios",
        "",
    ]
    ratio_rows = [
        [name, section_name, value]
        for section_name, section in results["sections"].items()
        for name, value in section.get("ratios", {}).items()
    ]
    parts.append(table(["ratio", "section", "value"], ratio_rows) if ratio_rows else "(none)")
    for name, section in results["sections"].items():
        parts += ["", f"## {name}", "", f"Status: {section['status']} ({section.get('seconds', '?')} s)."]
        if name == "gateway":
            parts.append(f"LiteLLM proxy: {section.get('litellm', '—')}.")
        columns = COLUMNS.get(name, [])
        if section.get("rows") and columns:
            cells = [[r.get(k) for k, _ in columns] for r in section["rows"]]
            parts += ["", table([h for _, h in columns], cells)]
    return "\n".join(parts) + "\n"
