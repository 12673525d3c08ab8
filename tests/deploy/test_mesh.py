"""Mesh configuration: every file parses, names the chart's Services on port 50051, and speaks
HTTP/2 with gRPC-aware health checks, retries and deadlines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from gengate.api.server import SERVICE_NAME
from gengate.api.status import retry_metadata
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

ROOT = Path(__file__).resolve().parents[2]
MESH = ROOT / "deploy" / "mesh"
PORT = 50051
NAMESPACE = "gengate"

# `helm install gengate deploy/helm/gengate`: the release contains the chart name, so the
# Service is the chart name and the headless one adds -headless (templates/_helpers.tpl).
CHART_NAME = yaml.safe_load((ROOT / "deploy" / "helm" / "gengate" / "Chart.yaml").read_text())["name"]
SERVICE = CHART_NAME
HEADLESS = f"{CHART_NAME}-headless"


def mesh_files() -> list[Path]:
    return sorted(p for p in MESH.rglob("*") if p.suffix in (".yaml", ".yml"))


def docs(path: Path) -> list[dict[str, Any]]:
    loaded = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert loaded and all(isinstance(d, dict) for d in loaded), path
    return loaded


def by_kind(kind: str) -> list[dict[str, Any]]:
    found = [d for path in mesh_files() for d in docs(path) if d.get("kind") == kind]
    assert found, f"no {kind} under deploy/mesh"
    return found


def fqdn(name: str) -> str:
    return f"{name}.{NAMESPACE}.svc.cluster.local"


def envoy() -> dict[str, Any]:
    (config,) = docs(MESH / "envoy" / "envoy.yaml")
    return config


def envoy_route() -> dict[str, Any]:
    (listener,) = envoy()["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    (vhost,) = hcm["typed_config"]["route_config"]["virtual_hosts"]
    (route,) = vhost["routes"]
    assert route["match"].get("grpc") == {}
    result: dict[str, Any] = route["route"]
    return result


def walk(node: Any) -> list[Any]:
    out = [node]
    if isinstance(node, dict):
        for child in node.values():
            out.extend(walk(child))
    elif isinstance(node, list):
        for child in node:
            out.extend(walk(child))
    return out


@pytest.mark.parametrize("path", mesh_files(), ids=lambda p: str(p.relative_to(MESH)))
def test_every_file_parses_and_uses_port_50051_only(path: Path) -> None:
    for doc in docs(path):
        if path.name != "envoy.yaml":
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["namespace"] == NAMESPACE
        ports = [
            node[key]
            for node in walk(doc)
            if isinstance(node, dict)
            for key in ("port", "number", "port_value")
            if isinstance(node.get(key), int)
        ]
        # The Envoy admin port is its own; everything gengate-facing is 50051.
        assert set(ports) - {9901} <= {PORT}, f"{path.name}: ports {ports}"


def test_istio_balances_per_call_and_ejects_failing_replicas() -> None:
    (rule,) = by_kind("DestinationRule")
    assert rule["spec"]["host"] == fqdn(SERVICE)
    policy = rule["spec"]["trafficPolicy"]
    assert policy["loadBalancer"]["simple"] == "LEAST_REQUEST"
    assert policy["connectionPool"]["http"]["maxRequestsPerConnection"] == 0
    outlier = policy["outlierDetection"]
    assert outlier["consecutiveGatewayErrors"] > 0 and outlier["maxEjectionPercent"] < 100


def test_istio_retries_unavailable_with_a_timeout() -> None:
    (service,) = by_kind("VirtualService")
    assert service["spec"]["hosts"] == [fqdn(SERVICE)]
    (route,) = service["spec"]["http"]
    (destination,) = route["route"]
    assert destination["destination"] == {"host": fqdn(SERVICE), "port": {"number": PORT}}
    assert route["timeout"].endswith("s")
    retry_on = route["retries"]["retryOn"].split(",")
    assert {"unavailable", "resource-exhausted"} <= set(retry_on)
    assert "internal" not in retry_on and "reset" not in retry_on  # may have reached a model


def test_grpcroute_sends_the_served_services_to_the_chart_service() -> None:
    (route,) = by_kind("GRPCRoute")
    (gateway,) = by_kind("Gateway")
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": SERVICE, "port": PORT}]
    served = {
        SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    }
    assert {m["method"]["service"] for m in rule["matches"]} == served
    (listener,) = gateway["spec"]["listeners"]
    assert listener["allowedRoutes"]["kinds"] == [{"kind": "GRPCRoute"}]


def test_envoy_gateway_policy_targets_the_route() -> None:
    (policy,) = by_kind("BackendTrafficPolicy")
    (target,) = policy["spec"]["targetRefs"]
    assert (target["kind"], target["name"]) == ("GRPCRoute", by_kind("GRPCRoute")[0]["metadata"]["name"])
    assert {"unavailable", "resource-exhausted"} <= set(policy["spec"]["retry"]["retryOn"]["triggers"])


def test_envoy_clusters_speak_http2_with_grpc_health_checks() -> None:
    clusters = envoy()["static_resources"]["clusters"]
    assert clusters
    for cluster in clusters:
        options = cluster["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        ]
        assert "http2_protocol_options" in options["explicit_http_config"], cluster["name"]
        assert cluster["lb_policy"] == "ROUND_ROBIN"
        assert cluster["type"] == "STRICT_DNS"  # one host per pod behind the headless Service
        (check,) = cluster["health_checks"]
        assert check["grpc_health_check"]["service_name"] == ""
        addresses = [
            e["endpoint"]["address"]["socket_address"]
            for group in cluster["load_assignment"]["endpoints"]
            for e in group["lb_endpoints"]
        ]
        assert addresses == [{"address": fqdn(HEADLESS), "port_value": PORT}]
    assert envoy_route()["cluster"] in {c["name"] for c in clusters}


def test_envoy_retries_honour_the_servers_retry_headers() -> None:
    policy = envoy_route()["retry_policy"]
    assert {"unavailable", "resource-exhausted"} <= set(policy["retry_on"].split(","))
    reset = policy["rate_limited_retry_back_off"]["reset_headers"]
    sent = dict(retry_metadata(2.5))
    assert sent == {"retry-after": "3", "grpc-retry-pushback-ms": "2500"}
    for header in reset:
        assert header["name"] in sent and header["format"] == "SECONDS"
    assert any(h["name"] == "retry-after" for h in reset)


def test_envoy_deadline_follows_grpc_timeout() -> None:
    route = envoy_route()
    assert route["timeout"] == "0s", "Envoy's default 15 s route timeout would cut streams"
    assert route["max_stream_duration"]["grpc_timeout_header_max"].endswith("s")
