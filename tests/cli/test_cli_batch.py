"""`gengate batch` end to end, as separate processes against `gengate serve`: submit a JSONL
file (a bad line is its item's error), status, list, results into a file that an interrupted
download resumes without a duplicate or a gap, `run` resuming its own job, and cancel errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_process import ServerProcess

GENGATE = [sys.executable, "-m", "gengate"]
CONFIG = {
    "models": [{"name": "echo", "backend": "scripted"}],
    "server": {"jobs": {"poll_s": 0.1}},
}


def gengate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GENGATE, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = ServerProcess(CONFIG, env={"GENGATE_DATA_DIR": str(tmp_path_factory.mktemp("cli-batch"))})
    yield server.address
    server.stop()


def _rows(path: Path, count: int, bad_at: int | None = None) -> Path:
    lines = [json.dumps({"prompt": f"row {i}", "seed": i}) for i in range(count)]
    if bad_at is not None:
        lines[bad_at] = '{"prompt": "unclosed'
    path.write_text("\n".join(lines) + "\n")
    return path


def _read(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_submit_status_results_and_resume(address: str, tmp_path: Path) -> None:
    rows = _rows(tmp_path / "rows.jsonl", 12, bad_at=4)
    submitted = gengate("batch", "submit", "--address", address, "--input", str(rows), "--model", "echo",
                        "--max-tokens", "8", "--name", "cli")  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().splitlines()[-1]
    assert job.startswith("job-")
    out = tmp_path / "out.jsonl"
    first = gengate("batch", "results", "--address", address, job, "--output", str(out), "--follow")
    assert first.returncode == 0, first.stderr
    assert "12/12 done" in first.stderr  # the progress line
    lines = _read(out)
    assert [line["index"] for line in lines] == list(range(12))
    assert lines[0]["response"]["generations"][0]["text"] == "row 0"  # type: ignore[index]
    assert lines[4]["error"]["code"] == "INVALID_ARGUMENT"  # type: ignore[index]
    assert lines[4]["error"]["reason"] == "INVALID_JSON_LINE"  # type: ignore[index]
    status = gengate("batch", "status", "--address", address, job, "--json")
    state = json.loads(status.stdout)
    assert (state["state"], state["total"], state["done"], state["failed"]) == ("succeeded", 12, 12, 1)

    # An interrupted download: 5 whole lines and half of the sixth. Re-running completes it.
    text = out.read_text().splitlines(keepends=True)
    out.write_text("".join(text[:5]) + text[5][:20])
    again = gengate("batch", "results", "--address", address, job, "--output", str(out))
    assert again.returncode == 0, again.stderr
    assert out.read_text() == "".join(text)  # no duplicate, no gap, the half line replaced

    listed = gengate("batch", "list", "--address", address, "--json")
    assert job in [json.loads(line)["id"] for line in listed.stdout.splitlines()]
    cancel = gengate("batch", "cancel", "--address", address, job)
    assert cancel.returncode == 1 and "FAILED_PRECONDITION" in cancel.stderr


def test_run_resumes_its_own_job(address: str, tmp_path: Path) -> None:
    rows = _rows(tmp_path / "rows.jsonl", 6)
    out = tmp_path / "out.jsonl"
    args = [
        "batch",
        "run",
        "--address",
        address,
        "--input",
        str(rows),
        "--model",
        "echo",
        "--output",
        str(out),
    ]
    first = gengate(*args)
    assert first.returncode == 0, first.stderr
    job = first.stdout.strip().splitlines()[-1]
    lines = out.read_text()
    second = gengate(*args)  # the same input and flags: the same job, nothing written twice
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip().splitlines()[-1] == job
    assert out.read_text() == lines and len(lines.splitlines()) == 6


def test_unknown_job_and_bad_input_fail_clearly(address: str, tmp_path: Path) -> None:
    missing = gengate("batch", "status", "--address", address, "job-nope")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    refused = gengate("batch", "submit", "--address", address, "--input", str(empty))
    assert refused.returncode == 2 and "holds no request" in refused.stderr
