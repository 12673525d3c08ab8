"""`gengate serve` in its own process, for tests that need a real process (fuzzing, kill -9)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import yaml


class ServerProcess:
    """`gengate serve` on a free port, its log collected for the worker's start and restart lines."""

    def __init__(self, config: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="gengate-serve-")
        path = Path(self._dir.name) / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gengate", "serve", "--config", str(path), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.address = self._wait()

    def _wait(self) -> str:
        assert self.proc.stdout is not None
        found: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line)
                if m := re.search(r"serving on (\S+)", line):
                    found.append(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        ready.wait(180)
        if not found:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log[-30:]))
        return found[0]

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        self.proc.kill()
        self.proc.wait()
        self._dir.cleanup()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._dir.cleanup()
