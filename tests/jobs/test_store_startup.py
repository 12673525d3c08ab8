"""`gengate serve` with a PostgreSQL job store it cannot open: one error line naming the store,
exit 2, no traceback, and never the password of the store's URL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def test_an_unreachable_postgres_store_stops_the_start_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("psycopg")
    with socket.socket() as sock:  # a port nothing listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = f"postgresql://gengate:s3cret-pw@127.0.0.1:{port}/x"
    config = tmp_path / "gengate.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": [{"name": "echo", "backend": "scripted"}],
                "server": {"host": "127.0.0.1", "port": 0, "jobs": {"store": store}},
            }
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "gengate", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GENGATE_DATA_DIR": str(tmp_path)},
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "s3cret-pw" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("gengate: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert f"the job store at postgresql://127.0.0.1:{port}/x cannot be opened" in errors[0]
    assert "OperationalError" in errors[0] and "refused" in errors[0]
