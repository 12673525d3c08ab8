"""Installing a Debian package for a test's real component (PostgreSQL, Redis), as the tests' own
set-up does on a fresh machine: `apt-get install`, with one `apt-get update` for a stale list."""

from __future__ import annotations

import os
import shutil
import subprocess


def apt_install(package: str) -> str:
    """Installs `package`; returns why it could not ('' when it did)."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    if os.geteuid() != 0:
        return "installing with apt-get needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    tail = "no output"
    for attempt in (install, ["apt-get", "update"], install):  # a stale package list: update once
        try:
            done = subprocess.run(attempt, capture_output=True, text=True, env=env, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(attempt)} failed: {exc}"
        if attempt is install and done.returncode == 0:
            return ""
        lines = (done.stderr or done.stdout).strip().splitlines()
        tail = lines[-1] if lines else tail
    return f"apt-get install -y {package} failed: {tail}"
