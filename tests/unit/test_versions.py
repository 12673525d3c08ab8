"""Versions come from one place, the repository's VERSION file: every package says the same, and
`gengate --version` and each client report it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import gengate_client

ROOT = Path(__file__).resolve().parents[2]
VERSION = (ROOT / "VERSION").read_text().strip()


def test_the_version_is_semver() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+(-[0-9A-Za-z.]+)?", VERSION), VERSION


def test_every_package_has_the_version() -> None:
    for pyproject in (ROOT / "pyproject.toml", ROOT / "clients/python/pyproject.toml"):
        assert tomllib.loads(pyproject.read_text())["project"]["version"] == VERSION, pyproject
    assert json.loads((ROOT / "clients/typescript/package.json").read_text())["version"] == VERSION
    go = (ROOT / "clients/go/gengate/version.go").read_text()
    assert f'const Version = "{VERSION}"' in go
    ts = (ROOT / "clients/typescript/src/version.ts").read_text()
    assert f'export const VERSION = "{VERSION}";' in ts
    assert f"## {VERSION}" in (ROOT / "CHANGELOG.md").read_text()


def test_the_server_and_the_python_client_report_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gengate", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"gengate {VERSION} (contract gengate.v1)"
    assert gengate_client.__version__ == VERSION
