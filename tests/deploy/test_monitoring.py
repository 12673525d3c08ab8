"""The Grafana dashboard and the Prometheus adapter's rules name only what the server exports.
(The chart's PrometheusRule, ServiceMonitor and HPA are checked rendered, in test_helm_render, and
against the Prometheus operator's own API by monitoringcheck: test_monitoring_check.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from gengate.metrics import catalogue
from promql import problems

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "gengate.json"
ADAPTER = ROOT / "deploy" / "monitoring" / "prometheus-adapter-values.yaml"


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_the_checker_catches_renamed_metrics_and_labels() -> None:
    assert problems('sum by (model) (rate(gengate_requests_total{code="OK"}[5m]))') == []
    assert problems("rate(gengate_request_total[5m])") == ["unknown metric gengate_request_total"]
    assert problems('gengate_requests_total{kind="x"}') == ["gengate_requests_total has no label kind"]
    assert problems("sum by (gpu) (gengate_requests_total)") == [
        "grouping by gpu, which none of the metrics has"
    ]


def test_dashboard_is_importable_grafana_json() -> None:
    data = dashboard()
    assert data["uid"] == "gengate" and data["schemaVersion"] >= 36
    variables = {v["name"]: v for v in data["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    for name in ("namespace", "model"):
        assert problems(variables[name]["definition"].removeprefix("label_values(").rsplit(",", 1)[0]) == []
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    for panel in data["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


@pytest.mark.parametrize("panel", panels(), ids=lambda p: p["title"])
def test_every_panel_queries_exported_series(panel: dict[str, Any]) -> None:
    assert panel["datasource"]["uid"] == "${datasource}"
    assert panel["targets"], panel["title"]
    for target in panel["targets"]:
        assert problems(target["expr"]) == [], target["expr"]
        assert target["datasource"]["uid"] == "${datasource}"


def test_the_dashboard_shows_every_gengate_family() -> None:
    exprs = " ".join(t["expr"] for p in panels() for t in p["targets"])
    unshown = [
        name
        for name in catalogue()
        if not name.startswith("process_")
        and name != "gengate_constraint_checker_kills"
        and name not in exprs
    ]
    # The sandbox's own counters are for debugging a hostile load; the rest is on the dashboard.
    assert unshown == ["gengate_constraint_checks"]


def test_the_adapter_serves_the_metric_the_hpa_asks_for() -> None:
    values = yaml.safe_load(ADAPTER.read_text())
    (rule,) = values["rules"]["custom"]
    assert values["rules"]["default"] is False
    assert rule["name"]["as"] == "gengate_in_flight_requests"
    assert problems(rule["seriesQuery"]) == []
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    kind, labels = catalogue()["gengate_in_flight_requests"]
    assert kind == "gauge" and "model" in labels
    hpa = (ROOT / "deploy" / "helm" / "gengate" / "templates" / "hpa.yaml").read_text()
    assert "name: gengate_in_flight_requests" in hpa
