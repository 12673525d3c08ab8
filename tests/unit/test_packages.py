"""The Python packages build as users install them: `python -m build` makes a wheel and an sdist of
the server and of the client, with the files they need, and the client wheel imports on its own."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = (ROOT / "VERSION").read_text().strip()


def build(project: Path, out: Path) -> tuple[Path, Path]:
    """(wheel, sdist) of `project`, built without network (--no-isolation: this venv's setuptools)."""
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(project)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


@pytest.fixture(scope="module")
def client_dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build(ROOT / "clients/python", tmp_path_factory.mktemp("client"))


def test_the_client_wheel_holds_the_sdk_and_the_stubs(client_dists: tuple[Path, Path]) -> None:
    wheel, sdist = client_dists
    assert wheel.name == f"gengate_client-{VERSION}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "gengate_client/__init__.py",
        "gengate_client/py.typed",
        "gengate_proto/v1/generation_pb2.py",
    ):
        assert needed in names, needed
    assert not any(n.startswith(("tests/", "gengate/")) for n in names)
    assert f"gengate_client-{VERSION}/pyproject.toml" in tarfile.open(sdist).getnames()


def test_the_client_wheel_imports_from_where_it_is_installed(
    client_dists: tuple[Path, Path], tmp_path: Path
) -> None:
    wheel, _ = client_dists
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
    )
    code = "import gengate_client, gengate_proto; print(gengate_client.__file__, gengate_client.__version__)"
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    path, version = out.stdout.split()
    assert path.startswith(str(target)) and version == VERSION


def test_the_server_wheel_has_every_layer_and_the_cli(tmp_path: Path) -> None:
    wheel, sdist = build(ROOT, tmp_path)
    assert wheel.name == f"gengate-{VERSION}-py3-none-any.whl"
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    for needed in ("gengate/api/server.py", "gengate/engines/mlx/backend.py", "gengate/workers/main.py"):
        assert needed in names, needed
    entry_points = archive.read(f"gengate-{VERSION}.dist-info/entry_points.txt").decode()
    assert "gengate = gengate.cli:main" in entry_points
    assert f"gengate-{VERSION}/pyproject.toml" in tarfile.open(sdist).getnames()
