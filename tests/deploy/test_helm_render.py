"""The Helm chart rendered and linted by Helm itself, then checked object by object.

No helm binary here: tests/deploy/helmrender is a small Go program on Helm's own library
(helm.sh/helm/v3): `helm template` (values coalesced and validated against values.schema.json,
the chart's kubeVersion checked, Helm's engine and manifest sorter) and `helm lint --strict`.
Skipped only where there is no Go toolchain; a failed build fails.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from gengate.config import parse_config
from promql import problems

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gengate"
RENDERER = Path(__file__).resolve().parent / "helmrender"
MESH = ROOT / "deploy" / "mesh"
SCHEMA_REFUSED = "values don't meet the specifications of the schema(s)"
MonitoringCheck = Callable[..., subprocess.CompletedProcess[str]]  # conftest's monitoringcheck

# The first test builds the renderer: Helm's library and its Kubernetes dependencies take about
# 5 minutes to compile with a cold Go build cache on 2 cores (seconds once cached), past the
# suite's 300 s per-test timeout. Every subprocess below has its own timeout.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="session")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain to build the chart renderer")
    binary = tmp_path_factory.mktemp("helmrender") / "helmrender"
    build = subprocess.run(
        [go, "build", "-o", str(binary), "."], cwd=RENDERER, capture_output=True, text=True, timeout=1400
    )
    assert build.returncode == 0, f"building tests/deploy/helmrender failed:\n{build.stderr}"
    return binary


def overrides_file(tmp_path: Path, overrides: dict[str, Any] | None) -> list[str]:
    if overrides is None:
        return []
    extra = tmp_path / "values-override.yaml"
    extra.write_text(yaml.safe_dump(overrides))
    return ["-f", str(extra)]


def render(
    renderer: Path,
    tmp_path: Path,
    overrides: dict[str, Any] | None = None,
    name: str = "gengate",
    kube_version: str | None = None,
) -> subprocess.CompletedProcess[str]:
    args = [str(renderer), "-chart", str(CHART), "-name", name, "-namespace", "gengate"]
    if kube_version is not None:
        args += ["-kube-version", kube_version]
    args += overrides_file(tmp_path, overrides)
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def lint(
    renderer: Path, tmp_path: Path, overrides: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    args = [str(renderer), "-lint", "-strict", "-chart", str(CHART), "-namespace", "gengate"]
    args += overrides_file(tmp_path, overrides)
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def objects(
    renderer: Path,
    tmp_path: Path,
    overrides: dict[str, Any] | None = None,
    name: str = "gengate",
    kube_version: str | None = None,
) -> dict[tuple[str, str], dict[str, Any]]:
    proc = render(renderer, tmp_path, overrides, name, kube_version)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    out = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(out) == len(docs), "two objects share a kind and name"
    return out


def container(objs: dict[tuple[str, str], dict[str, Any]], name: str = "gengate") -> dict[str, Any]:
    (c,) = objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = c
    return result


def test_default_render(renderer: Path, tmp_path: Path) -> None:
    objs = objects(renderer, tmp_path)
    assert set(objs) == {
        ("ConfigMap", "gengate"),
        ("Deployment", "gengate"),
        ("PodDisruptionBudget", "gengate"),
        ("Service", "gengate"),
        ("Service", "gengate-headless"),
        ("ServiceAccount", "gengate"),
    }
    deployment = objs[("Deployment", "gengate")]
    pod = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["selector"]["matchLabels"]
    assert pod and deployment["spec"]["template"]["metadata"]["labels"] == labels
    for kind, name in (("Service", "gengate"), ("Service", "gengate-headless")):
        spec = objs[(kind, name)]["spec"]
        assert spec["selector"] == labels
    grpc_port = {
        "name": "grpc",
        "port": 50051,
        "targetPort": "grpc",
        "protocol": "TCP",
        "appProtocol": "grpc",
    }
    metrics_port = {
        "name": "metrics",
        "port": 9464,
        "targetPort": "metrics",
        "protocol": "TCP",
        "appProtocol": "http",
    }
    assert objs[("Service", "gengate")]["spec"]["ports"] == [grpc_port, metrics_port]
    assert objs[("Service", "gengate-headless")]["spec"]["ports"] == [grpc_port]  # for gRPC clients only
    assert objs[("Service", "gengate-headless")]["spec"]["clusterIP"] == "None"
    assert objs[("PodDisruptionBudget", "gengate")]["spec"]["selector"]["matchLabels"] == labels

    c = container(objs)
    assert c["image"] == "gengate:0.1.0"
    assert c["args"] == ["--config", "/etc/gengate/gengate.yaml", "--metrics-port", "9464"]
    assert c["ports"] == [
        {"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9464, "protocol": "TCP"},
    ]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 50051, "service": ""}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts == {"/tmp": "tmp", "/etc/gengate": "config"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "gengate"
    assert pod["automountServiceAccountToken"] is False
    assert "nodeSelector" not in pod and "tolerations" not in pod and "runtimeClassName" not in pod


def test_rendered_config_is_what_gengate_loads(renderer: Path, tmp_path: Path) -> None:
    objs = objects(renderer, tmp_path)
    text = objs[("ConfigMap", "gengate")]["data"]["gengate.yaml"]
    config = parse_config(yaml.safe_load(text), source="configmap")
    assert [(m.name, m.backend, m.max_concurrency) for m in config.models] == [("tiny", "llamacpp", 4)]

    changed = objects(renderer, tmp_path, {"config": {"models": [{"name": "e", "backend": "scripted"}]}})
    annotation = "checksum/config"

    def checksum(o: dict[tuple[str, str], dict[str, Any]]) -> str:
        value: str = o[("Deployment", "gengate")]["spec"]["template"]["metadata"]["annotations"][annotation]
        return value

    assert checksum(changed) != checksum(objs), "a config change must roll the pods"
    assert parse_config(yaml.safe_load(changed[("ConfigMap", "gengate")]["data"]["gengate.yaml"]))


def test_every_option_on(renderer: Path, tmp_path: Path) -> None:
    objs = objects(
        renderer,
        tmp_path,
        {
            "config": None,
            "image": {"repository": "registry.example.com/gengate-vllm", "tag": "1.2.3"},
            "secrets": {
                "existingSecret": "provider-keys",
                "keys": {"OPENAI_API_KEY": "openai", "ANTHROPIC_API_KEY": "anthropic"},
            },
            "extraEnv": [{"name": "GENGATE_TRACE_CONTENT", "value": "0"}],
            "headlessService": {"enabled": False},
            "autoscaling": {"enabled": True, "maxReplicas": 6},
            "gpu": {"enabled": True, "count": 2, "runtimeClassName": "nvidia"},
            "nodeSelector": {"pool": "gpu"},
            "podDisruptionBudget": {"enabled": False},
            "probes": {"readiness": {"service": "gengate.v1.GenerationService/tiny"}},
        },
    )
    assert ("ConfigMap", "gengate") not in objs and ("Service", "gengate-headless") not in objs
    assert ("PodDisruptionBudget", "gengate") not in objs
    hpa = objs[("HorizontalPodAutoscaler", "gengate")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gengate"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    deployment = objs[("Deployment", "gengate")]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    pod = deployment["spec"]["template"]["spec"]
    c = container(objs)
    assert c["image"] == "registry.example.com/gengate-vllm:1.2.3"
    assert c["args"] == ["--metrics-port", "9464"], "no config: the embedded default, metrics on"
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/tmp"]
    env = {e["name"]: e for e in c["env"]}
    for var, key in (("OPENAI_API_KEY", "openai"), ("ANTHROPIC_API_KEY", "anthropic")):
        assert env[var] == {"name": var, "valueFrom": {"secretKeyRef": {"name": "provider-keys", "key": key}}}
    assert env["GENGATE_TRACE_CONTENT"]["value"] == "0"
    assert c["resources"]["limits"] == {"memory": "4Gi", "nvidia.com/gpu": 2}
    assert c["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"}
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert c["readinessProbe"]["grpc"] == {"port": 50051, "service": "gengate.v1.GenerationService/tiny"}


def grace_period(objs: dict[tuple[str, str], dict[str, Any]]) -> int:
    value: int = objs[("Deployment", "gengate")]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    return value


def test_the_grace_period_covers_pre_stop_and_the_drain(renderer: Path, tmp_path: Path) -> None:
    assert grace_period(objects(renderer, tmp_path)) == 5 + 30 + 10  # drain_timeout_s defaults to 30
    assert grace_period(objects(renderer, tmp_path, {"config": None})) == 5 + 30 + 10
    models = [{"name": "e", "backend": "scripted"}]
    longer = {"config": {"server": {"drain_timeout_s": 120.5}, "models": models}, "preStopSleepSeconds": 0}
    assert grace_period(objects(renderer, tmp_path, longer)) == 0 + 121 + 10
    assert parse_config(longer["config"]).server.drain_timeout_s == 120.5


def test_keys_without_a_secret_name_fail_the_render(renderer: Path, tmp_path: Path) -> None:
    proc = render(renderer, tmp_path, {"secrets": {"keys": {"OPENAI_API_KEY": "openai"}}})
    assert proc.returncode != 0
    assert "secrets.existingSecret" in proc.stderr


def test_other_release_names_prefix_every_object(renderer: Path, tmp_path: Path) -> None:
    objs = objects(renderer, tmp_path, name="prod")
    assert {name for _, name in objs} == {"prod-gengate", "prod-gengate-headless"}
    assert container(objs, "prod-gengate")["image"] == "gengate:0.1.0"


def test_mesh_files_name_the_rendered_services(renderer: Path, tmp_path: Path) -> None:
    services = {name for kind, name in objects(renderer, tmp_path) if kind == "Service"}
    text = "\n".join(p.read_text() for p in MESH.rglob("*.yaml"))
    for name in ("gengate", "gengate-headless"):
        assert name in services
    assert (
        "gengate.gengate.svc.cluster.local" in text and "gengate-headless.gengate.svc.cluster.local" in text
    )


ALL_ON: dict[str, Any] = {
    "secrets": {"existingSecret": "keys", "keys": {"OPENAI_API_KEY": "openai"}},
    "extraEnv": [{"name": "OTEL_SERVICE_NAME", "value": "gengate"}],
    "extraEnvFrom": [{"configMapRef": {"name": "more-env"}}],
    "extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
    "extraVolumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    "imagePullSecrets": [{"name": "registry"}],
    "autoscaling": {"enabled": True, "inFlightRequests": {"enabled": True}},
    "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
    "gpu": {"enabled": True, "runtimeClassName": "nvidia", "nodeSelector": {"gpu": "true"}},
    "affinity": {"nodeAffinity": {}},
    "serviceAccount": {"annotations": {"a": "b"}},
    "service": {"annotations": {"c": "d"}},
    "podAnnotations": {"e": "f"},
    "podLabels": {"team": "ml"},
}


@pytest.mark.parametrize("version", ["1.27.0", "latest"])
@pytest.mark.parametrize("overrides", [None, ALL_ON], ids=["defaults", "all-on"])
def test_objects_match_the_kubernetes_schema(
    renderer: Path, tmp_path: Path, version: str, overrides: dict[str, Any] | None
) -> None:
    """Strict OpenAPI schemas: a misspelt or misplaced field fails, on the oldest Kubernetes
    the chart supports (native grpc probes) and the newest the validator knows."""
    kv = pytest.importorskip("kubernetes_validate")
    target = kv.latest_version() if version == "latest" else version
    objs = objects(renderer, tmp_path, overrides, kube_version=target)  # .Capabilities as that cluster
    assert len(objs) >= 6
    for (kind, name), obj in objs.items():
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # the Prometheus operator's CRDs: test_monitoring_objects_pass_the_operators_api
        try:
            kv.validate(obj, target, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{kind}/{name} on Kubernetes {target}: {exc.message} at {list(exc.path)}")


MONITORED: dict[str, Any] = {
    "metrics": {
        "port": 9500,
        "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kps"}, "errorRatio": 0.1},
    },
    "autoscaling": {"enabled": True, "inFlightRequests": {"enabled": True, "averageValue": "12"}},
}


def test_monitoring_objects(renderer: Path, tmp_path: Path) -> None:
    """ServiceMonitor, PrometheusRule and the in-flight HPA metric, rendered: the monitor scrapes
    the Service's `metrics` port, every alert queries series the server exports (test_monitoring's
    checker) with this release's selector, the HPA asks for the adapter's metric."""
    objs = objects(renderer, tmp_path, MONITORED)
    service = objs[("Service", "gengate")]
    (metrics_port,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
    assert metrics_port["port"] == 9500 and container(objs)["args"][-2:] == ["--metrics-port", "9500"]

    monitor = objs[("ServiceMonitor", "gengate")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["gengate"]}
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]

    rule = objs[("PrometheusRule", "gengate")]
    assert rule["metadata"]["labels"]["release"] == "kps"
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert len(alerts) == 8 and all(a.startswith("Gengate") for a in alerts)
    for name, alert in alerts.items():
        assert problems(alert["expr"]) == [], name
        assert 'namespace="gengate", service="gengate"' in alert["expr"], name
        assert alert["labels"]["severity"] in ("warning", "critical"), name
        assert "{{ $labels." in alert["annotations"]["summary"], name  # Prometheus' template, not Helm's
    assert "> 0.1" in alerts["GengateServerErrors"]["expr"]  # the threshold from values
    assert "> 30" in alerts["GengateSlowRequests"]["expr"]

    hpa = objs[("HorizontalPodAutoscaler", "gengate")]["spec"]["metrics"]
    assert hpa[1] == {
        "type": "Pods",
        "pods": {
            "metric": {"name": "gengate_in_flight_requests"},
            "target": {"type": "AverageValue", "averageValue": "12"},
        },
    }
    assert hpa[0]["resource"]["name"] == "cpu"


DURATIONS: dict[str, Any] = {
    "metrics": {
        "serviceMonitor": {"enabled": True, "interval": "1h30m", "scrapeTimeout": "1h29m59s999ms"},
        "prometheusRule": {"enabled": True, "labels": {"team": "ml", "release": "kube-prometheus-stack"}},
    },
}


@pytest.mark.parametrize(
    "overrides", [MONITORED, ALL_ON, DURATIONS], ids=["monitored", "all-on", "durations"]
)
def test_monitoring_objects_pass_the_operators_api(
    renderer: Path, monitoringcheck: MonitoringCheck, tmp_path: Path, overrides: dict[str, Any]
) -> None:
    """The rendered ServiceMonitor and PrometheusRule against the Prometheus operator's own API
    (tests/deploy/monitoringcheck): decoded strictly into its monitoringv1 types, metadata as the
    API server validates it, the CRDs' markers, the operator's and Prometheus' rulefmt's refusals."""
    proc = render(renderer, tmp_path, overrides)
    assert proc.returncode == 0, proc.stderr
    check = monitoringcheck(proc.stdout)
    assert check.returncode == 0, check.stderr
    assert sorted(check.stdout.splitlines()) == [
        "2 monitoring object(s) checked",
        "PrometheusRule/gengate (gengate/templates/prometheusrule.yaml): ok",
        "ServiceMonitor/gengate (gengate/templates/servicemonitor.yaml): ok",
    ]


def test_a_label_value_kubernetes_refuses_fails_the_monitoring_check(
    renderer: Path, monitoringcheck: MonitoringCheck, tmp_path: Path
) -> None:
    """Labels are passed to Kubernetes as they are (the schema types them as strings only): one the
    API server refuses renders, and the check names the object and the field."""
    bad = {"release": "kube prometheus"}
    overrides = {"metrics": {"serviceMonitor": {"enabled": True, "labels": bad}}}
    proc = render(renderer, tmp_path, overrides)
    assert proc.returncode == 0, proc.stderr
    check = monitoringcheck(proc.stdout)
    assert check.returncode == 1
    monitor = "ServiceMonitor/gengate (gengate/templates/servicemonitor.yaml)"
    assert f'{monitor}: metadata.labels: Invalid value: "kube prometheus"' in check.stderr, check.stderr


@pytest.mark.parametrize(
    ("monitor", "longer"),
    [
        ({"interval": "5s"}, "scrapeTimeout 10s is longer than its interval 5s"),  # the default timeout
        (
            {"interval": "10s", "scrapeTimeout": "10001ms"},
            "scrapeTimeout 10001ms is longer than its interval 10s",
        ),
        ({"interval": "1d", "scrapeTimeout": "1w"}, "scrapeTimeout 1w is longer than its interval 1d"),
    ],
    ids=["default-timeout", "ms", "weeks"],
)
def test_a_scrape_timeout_longer_than_the_interval_fails_the_render(
    renderer: Path, tmp_path: Path, monitor: dict[str, str], longer: str
) -> None:
    """The operator drops such a ServiceMonitor (scrapeTimeout greater than scrapeInterval) and
    Prometheus never scrapes: the chart refuses it instead (monitoringcheck catches it too)."""
    proc = render(renderer, tmp_path, {"metrics": {"serviceMonitor": {"enabled": True, **monitor}}})
    assert proc.returncode != 0, "rendered anyway"
    assert (
        f"metrics.serviceMonitor.{longer}: the Prometheus operator refuses such a ServiceMonitor"
        in proc.stderr
    )
    assert proc.stdout == ""


def test_metrics_off_renders_no_port_flag_or_monitor(renderer: Path, tmp_path: Path) -> None:
    objs = objects(renderer, tmp_path, {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}})
    assert ("ServiceMonitor", "gengate") not in objs
    c = container(objs)
    assert c["args"] == ["--config", "/etc/gengate/gengate.yaml"]
    assert [p["name"] for p in c["ports"]] == ["grpc"]
    assert [p["name"] for p in objs[("Service", "gengate")]["spec"]["ports"]] == ["grpc"]


def test_in_flight_autoscaling_without_metrics_fails_the_render(renderer: Path, tmp_path: Path) -> None:
    proc = render(
        renderer,
        tmp_path,
        {
            "metrics": {"enabled": False},
            "autoscaling": {"enabled": True, "inFlightRequests": {"enabled": True}},
        },
    )
    assert proc.returncode != 0
    assert "autoscaling.inFlightRequests needs metrics.enabled" in proc.stderr


@pytest.mark.parametrize("overrides", [None, ALL_ON, MONITORED], ids=["defaults", "all-on", "monitored"])
def test_the_chart_lints_clean_with_helm_strict(
    renderer: Path, tmp_path: Path, overrides: dict[str, Any] | None
) -> None:
    """`helm lint --strict`: Chart.yaml, values.yaml against the schema, every template rendered
    (optional ones too, with options on), its YAML, names and deprecated APIs; a warning fails."""
    proc = lint(renderer, tmp_path, overrides)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_lint_fails_on_what_the_schema_refuses(renderer: Path, tmp_path: Path) -> None:
    proc = lint(renderer, tmp_path, {"replicaCount": "three"})
    assert proc.returncode != 0
    assert "[ERROR] values.yaml" in proc.stdout and "/replicaCount" in proc.stdout, proc.stdout


# Each a mistake in the values Helm must refuse before rendering: (overrides, what the message names).
REFUSED: dict[str, tuple[dict[str, Any], list[str]]] = {
    "string-for-integer": ({"replicaCount": "three"}, ["'/replicaCount'", "want integer"]),
    "unknown-top-level-key": ({"replicas": 3}, ["additional properties 'replicas' not allowed"]),
    "unknown-section-key": ({"service": {"prot": 50051}}, ["'/service'", "'prot' not allowed"]),
    "unknown-nested-key": (
        {"probes": {"readiness": {"periodSecond": 3}}},
        ["'/probes/readiness'", "'periodSecond' not allowed"],
    ),
    "wrong-pull-policy": ({"image": {"pullPolicy": "Sometimes"}}, ["'/image/pullPolicy'", "'IfNotPresent'"]),
    "wrong-service-type": ({"service": {"type": "ExternalName"}}, ["'/service/type'", "'ClusterIP'"]),
    "port-out-of-range": ({"metrics": {"port": 70000}}, ["'/metrics/port'", "maximum"]),
    "no-gpus": ({"gpu": {"count": 0}}, ["'/gpu/count'", "minimum"]),
    "boolean-as-string": ({"headlessService": {"enabled": "yes"}}, ["'/headlessService/enabled'", "boolean"]),
    "label-not-a-string": ({"podLabels": {"team": 3}}, ["'/podLabels/team'", "want string"]),
    "not-a-quantity": (
        {"autoscaling": {"inFlightRequests": {"averageValue": "lots"}}},
        ["'/autoscaling/inFlightRequests/averageValue'"],
    ),
    "not-a-duration": (
        {"metrics": {"serviceMonitor": {"interval": "30"}}},
        ["'/metrics/serviceMonitor/interval'"],
    ),
    # Prometheus takes units in order, each once: the operator's CRD refuses 30s1m (its Duration pattern).
    "duration-units-out-of-order": (
        {"metrics": {"serviceMonitor": {"interval": "30s1m"}}},
        ["'/metrics/serviceMonitor/interval'", "'30s1m' does not match pattern"],
    ),
    "duration-unit-twice": (
        {"metrics": {"serviceMonitor": {"scrapeTimeout": "5s5s"}}},
        ["'/metrics/serviceMonitor/scrapeTimeout'", "'5s5s' does not match pattern"],
    ),
    "env-without-name": ({"extraEnv": [{"value": "1"}]}, ["'/extraEnv/0'", "missing property 'name'"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_mistyped_values_are_refused_by_the_schema(renderer: Path, tmp_path: Path, case: str) -> None:
    overrides, named = REFUSED[case]
    proc = render(renderer, tmp_path, overrides)
    assert proc.returncode != 0, f"{case}: rendered anyway"
    assert SCHEMA_REFUSED in proc.stderr, proc.stderr
    for text in named:
        assert text in proc.stderr, f"{case}: {text!r} not in {proc.stderr}"
    assert proc.stdout == ""


# Values the comments of values.yaml and deploy/README.md document: the schema must take them.
DOCUMENTED: dict[str, Any] = {
    "config": {"server": {"drain_timeout_s": 60}, "models": [{"name": "gpt", "backend": "openai"}], "x": [1]},
    "image": {"repository": "registry.example.com/gengate", "tag": "0.1.0", "pullPolicy": "Always"},
    "gpu": {"enabled": True, "nodeSelector": {"nvidia.com/gpu.present": "true"}, "runtimeClassName": "nv"},
    "resources": {"requests": {"cpu": 2, "memory": "2Gi"}, "limits": {"memory": "8Gi", "cpu": "4"}},
    "podDisruptionBudget": {"maxUnavailable": "50%"},
    "autoscaling": {"enabled": True, "inFlightRequests": {"enabled": True, "averageValue": 12}},
    "metrics": {"serviceMonitor": {"enabled": True, "interval": "1m30s", "labels": {"release": "kps"}}},
    "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 20000, "supplementalGroups": [5]},
    "securityContext": {"privileged": False, "capabilities": {"drop": ["ALL"]}},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
    "tmpVolume": {"sizeLimit": "512Mi"},
    "service": {"type": "LoadBalancer", "port": 443},
    "global": {"imageRegistry": "set by a parent chart"},
}


def test_documented_and_free_form_values_pass_the_schema(renderer: Path, tmp_path: Path) -> None:
    objs = objects(renderer, tmp_path, DOCUMENTED)
    assert objs[("PodDisruptionBudget", "gengate")]["spec"]["maxUnavailable"] == "50%"
    assert container(objs)["resources"]["limits"] == {"memory": "8Gi", "cpu": "4", "nvidia.com/gpu": 1}
    config = yaml.safe_load(objs[("ConfigMap", "gengate")]["data"]["gengate.yaml"])
    assert config["x"] == [1], "config is gengate's to validate, not the chart's"
    assert objects(renderer, tmp_path, {"config": None}), "config: null is the embedded default"


def test_the_chart_kube_version_is_enforced(renderer: Path, tmp_path: Path) -> None:
    """Chart.yaml's kubeVersion (native grpc probes need 1.27), checked by Helm as on install."""
    assert objects(renderer, tmp_path, kube_version="1.27.0")
    proc = render(renderer, tmp_path, kube_version="1.26.9")
    assert proc.returncode != 0
    refusal = "chart requires kubeVersion: >=1.27.0-0 which is incompatible with Kubernetes v1.26.9"
    assert refusal in proc.stderr


def test_notes_render(renderer: Path, tmp_path: Path) -> None:
    proc = render(renderer, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "gengate-headless.gengate.svc.cluster.local:50051" in proc.stderr  # NOTES.txt goes to stderr
    assert "NOTES" not in proc.stdout
