"""The Helm chart is consistent with itself and with gengate, without a helm binary.

Checked: Chart.yaml fields; values.yaml parses and its `config` is a valid gengate config;
values.schema.json describes exactly the keys of values.yaml (and refuses unknown ones where a
typo would hide); every `.Values` path a template reads exists, and every value is read by some
template; every
`include` names a defined template; template blocks balance; probes, ports and secrets are wired
the way the server and the mesh configuration expect.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from gengate.api.server import SERVICE_NAME
from gengate.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gengate"
TEMPLATES = CHART / "templates"

VALUES_REF = re.compile(r"\$?\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
ACTION = re.compile(r"{{-?\s*(.*?)\s*-?}}", re.DOTALL)


def values() -> dict[str, Any]:
    data = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(data, dict)
    return data


def schema() -> dict[str, Any]:
    data = json.loads((CHART / "values.schema.json").read_text())
    assert isinstance(data, dict)
    return data


def template_texts() -> dict[str, str]:
    files = sorted(p for p in TEMPLATES.iterdir() if p.suffix in (".yaml", ".tpl", ".txt"))
    return {p.name: p.read_text() for p in files}


def referenced_paths() -> set[tuple[str, ...]]:
    found: set[tuple[str, ...]] = set()
    for text in template_texts().values():
        for match in VALUES_REF.finditer(text):
            found.add(tuple(match.group(1).strip(".").split(".")))
    return found


def leaf_paths(node: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(node, dict) and node:
        for key, child in node.items():
            yield from leaf_paths(child, (*prefix, str(key)))
    else:
        yield prefix


def lookup(data: Any, path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return True


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == CHART.name
    assert chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"], "image tag defaults to appVersion"
    assert chart["kubeVersion"].startswith(">=1.27"), "native grpc probes need Kubernetes 1.27"


def test_every_referenced_value_exists() -> None:
    data = values()
    refs = referenced_paths()
    assert len(refs) > 30
    missing = sorted(".".join(p) for p in refs if not lookup(data, p))
    assert not missing, f"templates read values that values.yaml lacks: {missing}"


def test_every_value_is_read_by_a_template() -> None:
    refs = referenced_paths()
    unread = [
        ".".join(path) for path in leaf_paths(values()) if not any(path[: len(ref)] == ref for ref in refs)
    ]
    assert not unread, f"values.yaml keys no template reads: {unread}"


def test_includes_name_defined_templates_and_blocks_balance() -> None:
    texts = template_texts()
    defined = set(re.findall(r'{{-?\s*define "([^"]+)"', texts["_helpers.tpl"]))
    assert {"gengate.fullname", "gengate.labels", "gengate.selectorLabels", "gengate.grpcProbe"} <= defined
    for name, text in texts.items():
        for used in re.findall(r'include "([^"]+)"', text):
            assert used in defined, f"{name}: include {used!r} is not defined"
        opened = closed = 0
        for action in ACTION.findall(text):
            word = action.split(" ", 1)[0]
            if word in ("if", "range", "with", "define", "block"):
                opened += 1
            elif word == "end":
                closed += 1
        assert opened == closed, f"{name}: {opened} blocks opened, {closed} closed"
        assert text.count("{{") == text.count("}}"), name


def test_default_config_is_a_valid_gengate_config() -> None:
    config = parse_config(values()["config"], source="values.yaml")
    assert [m.name for m in config.models] == ["tiny"]
    assert "host" not in values()["config"].get("server", {}), "the entrypoint fixes host and port"


def test_probes_use_native_grpc_on_the_served_port() -> None:
    helpers = template_texts()["_helpers.tpl"]
    probe = helpers.split('define "gengate.grpcProbe"', 1)[1].split("{{- end }}", 1)[0]
    assert "grpc:" in probe and "port: 50051" in probe and "service: {{ .probe.service | quote }}" in probe
    deployment = template_texts()["deployment.yaml"]
    for kind in ("startup", "readiness", "liveness"):
        assert f'include "gengate.grpcProbe" (dict "probe" .Values.probes.{kind})' in deployment
        service = values()["probes"][kind]["service"]
        # "" is the whole server; otherwise one model's health name as the server registers it.
        assert service == "" or service.startswith(SERVICE_NAME + "/")
    assert "containerPort: 50051" in deployment and "name: grpc" in deployment


def test_services_are_grpc_on_50051() -> None:
    texts = template_texts()
    assert values()["service"]["port"] == 50051
    for name in ("service.yaml", "service-headless.yaml"):
        text = texts[name]
        assert "name: grpc" in text and "appProtocol: grpc" in text and "targetPort: grpc" in text
    assert "clusterIP: None" in texts["service-headless.yaml"]
    assert 'printf "%s-headless" (include "gengate.fullname" .)' in texts["_helpers.tpl"]


def test_provider_keys_come_only_from_an_existing_secret() -> None:
    data = values()
    assert data["secrets"] == {"existingSecret": "", "keys": {}}
    text = (CHART / "values.yaml").read_text()
    assert not re.search(r"(sk-[A-Za-z0-9]{8,}|api_key:\s*\S)", text), "a key-like value in values.yaml"
    deployment = template_texts()["deployment.yaml"]
    block = deployment.split("range $name, $key := .Values.secrets.keys", 1)[1].split("{{- end }}", 1)[0]
    assert "secretKeyRef:" in block and "name: {{ $.Values.secrets.existingSecret }}" in block
    assert 'fail "secrets.keys is set' in deployment


def test_config_is_mounted_where_the_entrypoint_args_point() -> None:
    deployment = template_texts()["deployment.yaml"]
    assert '$args = concat $args (list "--config" "/etc/gengate/gengate.yaml")' in deployment
    assert "mountPath: /etc/gengate" in deployment
    configmap = template_texts()["configmap.yaml"]
    assert "gengate.yaml: |" in configmap and "toYaml .Values.config" in configmap


def test_gpu_option_requests_the_device_resource() -> None:
    gpu = values()["gpu"]
    assert gpu["enabled"] is False and gpu["resourceName"] == "nvidia.com/gpu"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu["tolerations"]
    deployment = template_texts()["deployment.yaml"]
    assert "set $limits .Values.gpu.resourceName .Values.gpu.count" in deployment


def test_security_context_is_locked_down() -> None:
    data = values()
    assert data["podSecurityContext"]["runAsNonRoot"] is True
    assert data["podSecurityContext"]["runAsUser"] == 10001  # the image's USER
    assert data["securityContext"]["readOnlyRootFilesystem"] is True
    assert data["securityContext"]["allowPrivilegeEscalation"] is False
    assert "USER 10001:10001" in (ROOT / "Dockerfile").read_text()


def test_non_template_yaml_parses() -> None:
    for path in (CHART / "Chart.yaml", CHART / "values.yaml"):
        assert yaml.safe_load(path.read_text())


def test_metrics_port_is_wired_from_flag_to_container_service_and_monitor() -> None:
    """One value, metrics.port, is the flag gengate serves on, the container's and the Service's
    port named `metrics`, which the ServiceMonitor scrapes by name."""
    texts = template_texts()
    assert values()["metrics"]["enabled"] is True and values()["metrics"]["port"] == 9464
    assert '(list "--metrics-port" (toString .Values.metrics.port))' in texts["deployment.yaml"]
    assert (
        "- name: metrics\n              containerPort: {{ .Values.metrics.port }}" in texts["deployment.yaml"]
    )
    assert (
        "- name: metrics\n      port: {{ .Values.metrics.port }}\n      targetPort: metrics"
        in texts["service.yaml"]
    )
    assert "- port: metrics\n      path: /metrics" in texts["servicemonitor.yaml"]
    for name in ("servicemonitor.yaml", "prometheusrule.yaml"):
        assert texts[name].startswith("{{- if and .Values.metrics.enabled"), name


def test_the_schema_is_draft_07_and_closed_where_typos_hide() -> None:
    root = schema()
    assert root["$schema"] == "http://json-schema.org/draft-07/schema#"  # what Helm 3 documents
    assert root["additionalProperties"] is False
    props = root["properties"]
    closed = ["image", "serviceAccount", "secrets", "service", "gpu", "topologySpread", "probes"]
    closed += ["podDisruptionBudget", "autoscaling", "metrics", "tmpVolume"]
    for key in closed:
        assert props[key]["additionalProperties"] is False, key
    for key in ("config", "resources", "affinity", "podSecurityContext", "securityContext"):
        assert "additionalProperties" not in props[key] and "properties" not in props[key], key


def resolve(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    assert ref.startswith("#/definitions/"), ref
    target: dict[str, Any] = root["definitions"][ref.removeprefix("#/definitions/")]
    return target


def schema_paths(
    node: dict[str, Any], root: dict[str, Any], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    for key, child in resolve(node, root).get("properties", {}).items():
        yield (*prefix, key)
        yield from schema_paths(child, root, (*prefix, key))


def described(path: tuple[str, ...], root: dict[str, Any]) -> bool:
    node = root
    for key in path:
        node = resolve(node, root)
        if key in node.get("properties", {}):
            node = node["properties"][key]
        else:
            return node.get("additionalProperties", True) is not False  # a free-form map
    return True


def test_the_schema_describes_every_value_and_no_other() -> None:
    root = schema()
    undescribed = [".".join(p) for p in leaf_paths(values()) if not described(p, root)]
    assert not undescribed, f"values.yaml keys values.schema.json refuses: {undescribed}"
    data = values()
    extra = [".".join(p) for p in schema_paths(root, root) if p != ("global",) and not lookup(data, p)]
    assert not extra, f"values.schema.json describes keys values.yaml lacks: {extra}"
    for key in data:
        assert root["properties"][key].get("description"), f"{key}: no description in the schema"


def test_values_yaml_passes_its_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft7Validator.check_schema(schema())
    jsonschema.Draft7Validator(schema()).validate(values())
