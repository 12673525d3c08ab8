"""tests/deploy/monitoringcheck on hand-written objects: what it must refuse, and that it says where.

monitoringcheck (Go) checks ServiceMonitor, PodMonitor and PrometheusRule objects against the
Prometheus operator's own API (pkg/apis/monitoring v1): strict decoding into its types, metadata
as the API server validates it, the few CRD rules its kubebuilder markers add (copied verbatim in
the checker, and checked here against the module's source), the operator's and Prometheus'
rulefmt's own refusals. test_helm_render runs it on the chart's rendered objects. Each case below
breaks one field of a valid object; the message must name the object and the field.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

MONITORINGCHECK = Path(__file__).resolve().parent / "monitoringcheck"
MODULE = "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring"
MonitoringCheck = Callable[..., subprocess.CompletedProcess[str]]  # conftest's monitoringcheck
Mutation = Callable[[dict[str, Any]], None]

pytestmark = pytest.mark.timeout(900)  # the checker's first build, with a cold Go cache

CONFIG_MAP: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
VALID: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "sm", "labels": {"release": "kube-prometheus-stack"}},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": "gengate"}},
            "namespaceSelector": {"matchNames": ["gengate"]},
            "endpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "scheme": "http",
                    "interval": "30s",
                    "scrapeTimeout": "30s",
                }
            ],
        },
    },
    "PodMonitor": {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "pm", "namespace": "other"},
        "spec": {
            "selector": {"matchLabels": {"app": "gengate"}},
            "podMetricsEndpoints": [{"portNumber": 9464, "interval": "1m30s", "scrapeTimeout": "10s"}],
        },
    },
    "PrometheusRule": {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "rules"},
        "spec": {
            "groups": [
                {
                    "name": "g",
                    "interval": "1m",
                    "rules": [
                        {
                            "alert": "Down",
                            "expr": 'up{job="gengate"} == 0',
                            "for": "5m",
                            "keep_firing_for": "1m",
                            "labels": {"severity": "critical"},
                            "annotations": {
                                "summary": "{{ $labels.pod }}: {{ $value | humanizePercentage }}"
                            },
                        },
                        {"record": "job:up:sum", "expr": "sum by (job) (up)", "labels": {"team": "ml"}},
                    ],
                }
            ]
        },
    },
}
OK = ["ServiceMonitor/sm: ok", "PodMonitor/pm: ok", "PrometheusRule/rules: ok"]


def manifests(docs: list[dict[str, Any]]) -> str:
    return "".join("---\n" + yaml.safe_dump(d, sort_keys=False) for d in docs)


def keys(path: str) -> list[str | int]:
    return [int(k) if k.isdigit() else k for k in path.split(".")]


def parent(obj: dict[str, Any], path: str) -> tuple[Any, str | int]:
    *head, last = keys(path)
    node: Any = obj
    for k in head:
        node = node[k]
    return node, last


def put(path: str, value: Any) -> Mutation:
    def mutate(obj: dict[str, Any]) -> None:
        node, last = parent(obj, path)
        node[last] = value

    return mutate


def drop(path: str) -> Mutation:
    def mutate(obj: dict[str, Any]) -> None:
        node, last = parent(obj, path)
        del node[last]

    return mutate


def rename(path: str, new: str) -> Mutation:
    def mutate(obj: dict[str, Any]) -> None:
        node, last = parent(obj, path)
        node[new] = node.pop(last)

    return mutate


def second_group_named_g(obj: dict[str, Any]) -> None:
    obj["spec"]["groups"].append({"name": "g", "rules": [{"record": "r", "expr": "1"}]})


EP = "spec.endpoints.0"
PEP = "spec.podMetricsEndpoints.0"
ALERT = "spec.groups.0.rules.0"
RECORD = "spec.groups.0.rules.1"
SM, PM, PR = "ServiceMonitor/sm", "PodMonitor/pm", "PrometheusRule/rules"
# case: (the kind broken, how, what the message must say: "Kind/name: field: ...")
CASES: dict[str, tuple[str, Mutation, list[str]]] = {
    # Strict decoding, as the API server's strict field validation (kubectl's default).
    "unknown-endpoint-field": (
        "ServiceMonitor",
        put(f"{EP}.intervall", "30s"),
        [f'{SM}: unknown field "spec.endpoints[0].intervall"'],
    ),
    "field-name-in-the-wrong-case": (
        "ServiceMonitor",
        rename(f"{EP}.scrapeTimeout", "scrapetimeout"),
        [f'{SM}: unknown field "spec.endpoints[0].scrapetimeout"'],
    ),
    "unknown-spec-field": (
        "PodMonitor",
        rename("spec.podMetricsEndpoints", "podMetricEndpoints"),
        [f'{PM}: unknown field "spec.podMetricEndpoints"'],
    ),
    "unknown-metadata-field": (
        "PrometheusRule",
        put("metadata.label", {"a": "b"}),
        [f'{PR}: unknown field "metadata.label"'],
    ),
    "port-a-number-not-a-name": (
        "ServiceMonitor",
        put(f"{EP}.port", 9464),
        [f"{SM}: json: cannot unmarshal number into Go struct field Endpoint.spec.endpoints.port"],
    ),
    "interval-a-number": (
        "ServiceMonitor",
        put(f"{EP}.interval", 30),
        [f"{SM}: json: cannot unmarshal number into Go struct field Endpoint.spec.endpoints.interval"],
    ),
    "for-a-number": (
        "PrometheusRule",
        put(f"{ALERT}.for", 300),
        [f"{PR}: json: cannot unmarshal number into Go struct field Rule.spec.groups.rules.for"],
    ),
    "label-not-a-string": (
        "PrometheusRule",
        put(f"{ALERT}.labels.severity", 1),
        [f"{PR}: json: cannot unmarshal number into Go struct field Rule.spec.groups.rules.labels"],
    ),
    "annotation-not-a-string": (
        "PrometheusRule",
        put(f"{ALERT}.annotations.summary", True),
        [f"{PR}: json: cannot unmarshal bool into Go struct field Rule.spec.groups.rules.annotations"],
    ),
    # Metadata, as the API server validates every custom resource's.
    "name-not-a-dns-subdomain": (
        "ServiceMonitor",
        put("metadata.name", "Gengate_SM"),
        ['ServiceMonitor/Gengate_SM: metadata.name: Invalid value: "Gengate_SM"'],
    ),
    "label-value-kubernetes-refuses": (
        "ServiceMonitor",
        put("metadata.labels.release", "kube prometheus"),
        [f'{SM}: metadata.labels: Invalid value: "kube prometheus"'],
    ),
    # The CRDs' markers.
    "interval-not-a-duration": (
        "ServiceMonitor",
        put(f"{EP}.interval", "30"),
        [f'{SM}: spec.endpoints[0].interval: Invalid value: "30": not a Prometheus duration'],
    ),
    "duration-units-out-of-order": (
        "ServiceMonitor",
        put(f"{EP}.interval", "30s1m"),
        [f'{SM}: spec.endpoints[0].interval: Invalid value: "30s1m": not a Prometheus duration'],
    ),
    "pod-monitor-timeout-not-a-duration": (
        "PodMonitor",
        put(f"{PEP}.scrapeTimeout", "10 s"),
        [f'{PM}: spec.podMetricsEndpoints[0].scrapeTimeout: Invalid value: "10 s"'],
    ),
    "scheme-not-in-the-enum": (
        "ServiceMonitor",
        put(f"{EP}.scheme", "tcp"),
        [f'{SM}: spec.endpoints[0].scheme: Unsupported value: "tcp"', '"https"'],
    ),
    "endpoints-missing": (
        "ServiceMonitor",
        drop("spec.endpoints"),
        [f"{SM}: spec.endpoints: Required value"],
    ),
    "selector-missing": (
        "PodMonitor",
        drop("spec.selector"),
        [f"{PM}: spec.selector: Required value"],
    ),
    "spec-missing": ("PrometheusRule", drop("spec"), [f"{PR}: spec: Required value"]),
    "port-number-out-of-range": (
        "PodMonitor",
        put(f"{PEP}.portNumber", 0),
        [f"{PM}: spec.podMetricsEndpoints[0].portNumber: Invalid value: 0: must be between 1 and 65535"],
    ),
    "group-names-repeat": (
        "PrometheusRule",
        second_group_named_g,
        [f'{PR}: spec.groups[1].name: Duplicate value: "g"'],
    ),
    "group-name-empty": (
        "PrometheusRule",
        put("spec.groups.0.name", ""),
        [f'{PR}: spec.groups[0].name: Invalid value: ""'],
    ),
    "group-interval-not-a-duration": (
        "PrometheusRule",
        put("spec.groups.0.interval", "1 m"),
        [f'{PR}: spec.groups[0].interval: Invalid value: "1 m"'],
    ),
    "expr-missing": (
        "PrometheusRule",
        drop(f"{ALERT}.expr"),
        [f"{PR}: spec.groups[0].rules[0].expr: Required value"],
    ),
    "for-not-a-duration": (
        "PrometheusRule",
        put(f"{ALERT}.for", "5 minutes"),
        [f'{PR}: spec.groups[0].rules[0].for: Invalid value: "5 minutes": not a Prometheus duration'],
    ),
    "keep-firing-for-empty": (
        "PrometheusRule",
        put(f"{ALERT}.keep_firing_for", ""),
        [f'{PR}: spec.groups[0].rules[0].keep_firing_for: Invalid value: ""'],
    ),
    # The operator's own refusal, when it reconciles.
    "timeout-longer-than-the-interval": (
        "ServiceMonitor",
        put(f"{EP}.scrapeTimeout", "31s"),
        [f'{SM}: spec.endpoints[0].scrapeTimeout: Invalid value: "31s": longer than the interval "30s"'],
    ),
    # Prometheus' rule loader (rulefmt), which the operator runs on every PrometheusRule.
    "alert-and-record": (
        "PrometheusRule",
        put(f"{ALERT}.record", "job:down"),
        [
            f'{PR}: spec.groups[0].rules[0].record: Invalid value: "job:down": '
            "only one of 'record' and 'alert' must be set"
        ],
    ),
    "neither-alert-nor-record": (
        "PrometheusRule",
        drop(f"{ALERT}.alert"),
        [f"{PR}: spec.groups[0].rules[0].alert: Required value: one of 'record' or 'alert'"],
    ),
    "expr-empty": (
        "PrometheusRule",
        put(f"{ALERT}.expr", " "),
        [f"{PR}: spec.groups[0].rules[0].expr: Required value: field 'expr' must be set in rule"],
    ),
    "annotations-on-a-recording-rule": (
        "PrometheusRule",
        put(f"{RECORD}.annotations", {"summary": "x"}),
        [f"{PR}: spec.groups[0].rules[1].annotations: Forbidden: invalid field 'annotations'"],
    ),
    "for-on-a-recording-rule": (
        "PrometheusRule",
        put(f"{RECORD}.for", "5m"),
        [f"{PR}: spec.groups[0].rules[1].for: Forbidden: invalid field 'for' in recording rule"],
    ),
    "template-variable-misspelt": (
        "PrometheusRule",
        put(f"{ALERT}.annotations.summary", "{{ $label.pod }} is down"),
        [
            f"{PR}: spec.groups[0].rules[0].annotations[summary]: Invalid value:",
            'not a Prometheus alert template: template: alert:1: undefined variable "$label"',
        ],
    ),
    "template-action-unclosed": (
        "PrometheusRule",
        put(f"{ALERT}.labels.severity", "{{ if $labels.pod }}critical"),
        [f"{PR}: spec.groups[0].rules[0].labels[severity]: Invalid value:", "unexpected EOF"],
    ),
    # What the checker does not know is an error, not a pass.
    "unchecked-version": (
        "ServiceMonitor",
        put("apiVersion", "monitoring.coreos.com/v1alpha1"),
        [f"{SM}: apiVersion: monitoring.coreos.com/v1alpha1: only monitoring.coreos.com/v1 is checked"],
    ),
    "unchecked-kind": ("ServiceMonitor", put("kind", "Probe"), ['Probe/sm: kind: "Probe": not checked']),
}


def test_valid_objects_pass(monitoringcheck: MonitoringCheck, tmp_path: Path) -> None:
    text = manifests([CONFIG_MAP, *VALID.values()])
    proc = monitoringcheck(text)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [*OK, "3 monitoring object(s) checked"]
    path = tmp_path / "objects.yaml"
    path.write_text(text)
    from_file = monitoringcheck("", str(path))
    assert from_file.returncode == 0 and from_file.stdout == proc.stdout, from_file.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_field_fails_naming_the_object_and_field(
    monitoringcheck: MonitoringCheck, case: str
) -> None:
    kind, mutate, messages = CASES[case]
    docs = copy.deepcopy(VALID)
    mutate(docs[kind])
    proc = monitoringcheck(manifests([CONFIG_MAP, *docs.values()]))
    assert proc.returncode == 1, f"{case}: passed\n{proc.stdout}"
    for message in messages:
        assert message in proc.stderr, f"{case}: {message!r} not in\n{proc.stderr}"
    assert sorted(proc.stdout.splitlines()) == sorted(o for o in OK if not o.startswith(f"{kind}/")), case


def test_a_key_twice_fails(monitoringcheck: MonitoringCheck) -> None:
    text = manifests([VALID["ServiceMonitor"]])
    twice = text.replace("- port: metrics\n", "- port: metrics\n    port: grpc\n", 1)
    assert twice != text
    proc = monitoringcheck(twice)
    assert proc.returncode == 1
    line = twice.splitlines().index("    port: grpc") + 1  # the document's reader keeps its ---
    assert (
        f'ServiceMonitor/sm: yaml: unmarshal errors: line {line}: key "port" already set in map'
        in proc.stderr
    )


def test_no_monitoring_object_is_an_error(monitoringcheck: MonitoringCheck) -> None:
    proc = monitoringcheck(manifests([CONFIG_MAP]))
    assert proc.returncode == 1
    assert "no ServiceMonitor, PodMonitor or PrometheusRule found" in proc.stderr


def comment_above(lines: list[str], i: int) -> list[str]:
    block = []
    while i > 0 and lines[i - 1].strip().startswith("//"):
        i -= 1
        block.append(lines[i].strip().removeprefix("//").strip())
    return block


def test_the_markers_it_enforces_are_the_modules(monitoringcheck: MonitoringCheck) -> None:
    """Every CRD rule the checker enforces beyond the Go types is a kubebuilder marker copied from
    pkg/apis/monitoring: each line is still there, above the declaration it names, in the version
    go.mod pins (a bump that changes one fails here)."""
    proc = monitoringcheck("", "-markers")
    assert proc.returncode == 0, proc.stderr
    markers: dict[str, dict[str, str]] = json.loads(proc.stdout)
    assert len(markers) >= 10
    go = shutil.which("go")
    assert go is not None  # the fixture built the checker with it
    listing = subprocess.run(
        [go, "list", "-m", "-f", "{{.Dir}}", MODULE],
        cwd=MONITORINGCHECK,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listing.returncode == 0, listing.stderr
    source = Path(listing.stdout.strip()) / "v1"
    for key, marker in markers.items():
        lines = (source / marker["file"]).read_text().splitlines()
        found = [i for i, line in enumerate(lines) if line.strip() == marker["decl"]]
        assert found, f"{key}: {marker['decl']!r} is not in {marker['file']}"
        for i in found:
            assert marker["line"] in comment_above(lines, i), (
                f"{key}: {marker['line']!r} not on {marker['decl']!r}"
            )
