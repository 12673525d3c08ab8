"""Fixtures shared by the deploy tests."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

MONITORINGCHECK = Path(__file__).resolve().parent / "monitoringcheck"
MonitoringCheck = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture(scope="session")
def monitoringcheck(tmp_path_factory: pytest.TempPathFactory) -> MonitoringCheck:
    """tests/deploy/monitoringcheck, built once: the Prometheus operator's objects against its own
    Go API (github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring). About a minute
    with a cold Go build cache (k8s.io/api and apimachinery), seconds once cached; the tests that
    use it carry a timeout that covers the cold build. Skipped only where there is no Go toolchain;
    a failed build fails. Returns a function: check(manifests, *args) runs it on manifests (all of a
    render: other kinds are skipped), objects without a namespace taken as in `gengate`."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain to build monitoringcheck")
    binary = tmp_path_factory.mktemp("monitoringcheck") / "monitoringcheck"
    build = subprocess.run(
        [go, "build", "-o", str(binary), "."],
        cwd=MONITORINGCHECK,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert build.returncode == 0, f"building tests/deploy/monitoringcheck failed:\n{build.stderr}"

    def check(manifests: str = "", *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(binary), "-namespace", "gengate", *args],
            input=manifests,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return check
