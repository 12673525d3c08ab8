"""The Envoy and Istio files against those projects' own protobuf types.

tests/deploy/meshcheck (Go) decodes envoy.yaml as an Envoy v3 Bootstrap with go-control-plane
(unknown fields and unknown typed_config types rejected, then every protoc-gen-validate rule,
inside typed_config too) and each Istio resource's spec with istio.io/api. Skipped only where
there is no Go toolchain.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKER = Path(__file__).resolve().parent / "meshcheck"
ENVOY = ROOT / "deploy" / "mesh" / "envoy" / "envoy.yaml"
ISTIO = sorted((ROOT / "deploy" / "mesh" / "istio").glob("*.yaml"))


@pytest.fixture(scope="session")
def meshcheck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain to build meshcheck")
    binary = tmp_path_factory.mktemp("meshcheck") / "meshcheck"
    subprocess.run([go, "build", "-o", str(binary), "."], cwd=CHECKER, check=True, timeout=900)
    return binary


def check(binary: Path, *paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary), *map(str, paths)], capture_output=True, text=True, timeout=60)


def test_shipped_envoy_and_istio_files_are_valid(meshcheck: Path) -> None:
    assert ISTIO
    proc = check(meshcheck, ENVOY, *ISTIO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(": ok") == 1 + len(ISTIO)


@pytest.mark.parametrize(
    ("source", "old", "new", "complaint"),
    [
        (
            ENVOY,
            "grpc_timeout_header_max",
            "grpc_timeout_header_mx",
            'unknown field "grpc_timeout_header_mx"',
        ),
        (ENVOY, "lb_policy: ROUND_ROBIN", "lb_policy: ROUND_ROBN", "invalid value for enum"),
        (ENVOY, "stat_prefix: gengate", 'stat_prefix: ""', "StatPrefix"),  # a rule inside typed_config
        (ENVOY, "port_value: 50051", "port_value: 70000", "PortValue"),
        (ENVOY, "HttpProtocolOptions\n", "HttpProtocolOption\n", "unable to resolve"),
        (
            ROOT / "deploy/mesh/istio/destinationrule.yaml",
            "LEAST_REQUEST",
            "FEWEST",
            "invalid value for enum",
        ),
        (ROOT / "deploy/mesh/istio/virtualservice.yaml", "retryOn:", "retryOnn:", 'unknown field "retryOnn"'),
    ],
    ids=["unknown-field", "bad-enum", "pgv-in-any", "pgv-range", "unknown-type", "istio-enum", "istio-field"],
)
def test_checker_catches_mistakes(
    meshcheck: Path, tmp_path: Path, source: Path, old: str, new: str, complaint: str
) -> None:
    text = source.read_text()
    assert old in text
    broken = tmp_path / source.name
    broken.write_text(text.replace(old, new, 1))
    proc = check(meshcheck, broken)
    assert proc.returncode == 1
    assert complaint in proc.stderr, proc.stderr
