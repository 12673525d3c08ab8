"""Checks PromQL written against gengate's metrics (alerts, dashboards): every metric it names is
a series the server exports, every label it selects or groups by is one that series has.

Not a PromQL parser: metric names are gengate's own prefixes, selectors are `{label op "value"}`,
groupings `by (...)`/`on (...)`; enough to catch a renamed metric or label, the usual breakage.
"""

from __future__ import annotations

import re

from gengate.metrics import catalogue

# Labels Prometheus adds to every scraped series (the target's; the operator's ServiceMonitor).
TARGET_LABELS = frozenset({"namespace", "service", "pod", "job", "instance", "endpoint", "container"})
# A metric name, not a label of the same prefix in a selector (gen_ai_request_model="...").
_METRIC = re.compile(r"\b((?:gengate|gen_ai|process)_[a-z0-9_]+)\b(?!\s*(?:=|!=|!~))(\{[^}]*\})?")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")


def series() -> dict[str, frozenset[str]]:
    """Every sample name the server exports -> the labels it carries."""
    out: dict[str, frozenset[str]] = {}
    for name, (kind, labels) in catalogue().items():
        base = frozenset(labels)
        if kind == "counter":
            out[name + "_total"] = base
        elif kind == "histogram":
            out[name + "_bucket"] = base | {"le"}
            out[name + "_sum"] = out[name + "_count"] = base
        else:
            out[name] = base
    return out


def problems(expr: str) -> list[str]:
    """What in `expr` is not something the server exports (empty: it is all known)."""
    known = series()
    found: list[str] = []
    labels: set[str] = set(TARGET_LABELS)
    for match in _METRIC.finditer(_GROUPING.sub("", expr)):
        name, selector = match.group(1), match.group(2) or ""
        if name not in known:
            found.append(f"unknown metric {name}")
            continue
        labels |= known[name]
        for label in _MATCHER.findall(selector):
            if label not in known[name] | TARGET_LABELS:
                found.append(f"{name} has no label {label}")
    for group in _GROUPING.findall(expr):
        for label in (g.strip() for g in group.split(",") if g.strip()):
            if label not in labels:
                found.append(f"grouping by {label}, which none of the metrics has")
    if not _METRIC.search(expr):
        found.append("names no gengate metric")
    if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
        found.append("unbalanced brackets")
    return found
