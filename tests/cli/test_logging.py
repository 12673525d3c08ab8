"""Logs as operators read them: `--log-format json` writes one JSON object per line (server and
workers alike), every line logged while a call is served names its request id, model and caller,
`--log-level` sets the level, and upstream SDKs' per-call HTTP lines are DEBUG only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from gengate_client import Client, GengateError
from serve_process import ServerProcess

SNIPPET = """
import logging, sys
from gengate.caller import set_current
from gengate.callers.identity import Caller
from gengate.logs import about_request, configure_logging
from gengate.redaction import register_secret
configure_logging(sys.argv[1], sys.argv[2])
register_secret("sk-live-CANARY-0123456789abcdef")
log = logging.getLogger("gengate.test")
log.info("outside any call")
set_current(Caller("team-a"))
with about_request("req-1", "tiny"):
    log.info("inside %s", "the call")
    try:
        raise ValueError("boom with sk-live-CANARY-0123456789abcdef inside")
    except ValueError:
        log.exception("it failed")
log.debug("only at debug")
logging.getLogger("httpx").info("HTTP Request: POST https://api.example/v1/chat 200")
logging.getLogger("httpx2").info("HTTP Request: POST https://api.example/v1/messages 200")
logging.getLogger("httpcore2.http11").info("send_request_headers.complete")
"""


def run(level: str, fmt: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", SNIPPET, level, fmt], capture_output=True, text=True, check=True
    )
    return out.stderr.splitlines()


def test_json_lines_carry_the_request_and_the_caller() -> None:
    lines = [json.loads(line) for line in run("INFO", "json") if line.startswith("{")]
    outside, inside, failed = lines[0], lines[1], lines[2]
    assert outside["message"] == "outside any call" and "request_id" not in outside
    assert {k: inside[k] for k in ("level", "logger", "message", "request_id", "model", "caller")} == {
        "level": "INFO",
        "logger": "gengate.test",
        "message": "inside the call",
        "request_id": "req-1",
        "model": "tiny",
        "caller": "team-a",
    }
    assert inside["time"].endswith("+00:00")
    assert failed["level"] == "ERROR" and "ValueError: boom with" in failed["exception"]
    assert len(lines) == 3, "DEBUG and httpx's (httpx2's) per-call lines are not logged at INFO"


def test_text_lines_tag_the_request_and_debug_shows_upstream_http() -> None:
    lines = run("DEBUG", "text")
    inside = next(line for line in lines if "inside the call" in line)
    assert inside.endswith("[request_id=req-1 model=tiny caller=team-a]")
    assert any("only at debug" in line for line in lines)
    assert any("HTTP Request: POST https://api.example/v1/chat" in line for line in lines)
    assert any("HTTP Request: POST https://api.example/v1/messages" in line for line in lines)
    assert any("send_request_headers.complete" in line for line in lines)


def test_the_quieted_loggers_are_the_ones_the_sdks_send_through() -> None:
    """The openai and anthropic SDKs send through httpx2 and httpcore2, cohere's through httpx:
    the names quieted are the ones those libraries log their per-call lines under."""
    from gengate.logs import CHATTY_HTTP_LOGGERS

    httpx = pytest.importorskip("httpx._client")
    httpx2 = pytest.importorskip("httpx2._client")
    core2 = pytest.importorskip("httpcore2._async.http11")
    for logger in (httpx.logger, httpx2.logger, core2.logger):
        assert logger.name.split(".")[0] in CHATTY_HTTP_LOGGERS


def test_serve_and_its_workers_log_json_naming_the_request() -> None:
    config = {
        "models": [
            {"name": "flaky", "backend": "scripted", "isolation": "process", "fail_after_tokens": 0},
        ]
    }
    server = ServerProcess(config, env={"GENGATE_LOG_FORMAT": "json", "GENGATE_LOG_LEVEL": "DEBUG"})
    try:
        with Client(server.address) as client, pytest.raises(GengateError):
            client.generate("flaky", "hi", request_id="req-flaky-1")
        deadline = time.monotonic() + 60
        while not any("req-flaky-1" in line for line in server.log) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop()
    records = [json.loads(line) for line in server.log if line.startswith("{")]
    text_shaped = re.compile(r"^\d{4}-\d\d-\d\d[ T]\S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
    plain = [line for line in server.log if text_shaped.match(line) or "worker[" in line]
    assert not plain, f"log lines not in JSON: {plain[:3]}"
    assert any(r["logger"] == "gengate" and "serving on" in r["message"] for r in records)
    worker = [r for r in records if r.get("worker") == "flaky" and r.get("request_id") == "req-flaky-1"]
    assert worker and worker[0]["model"] == "flaky", records[-10:]


def test_configuring_in_process_keeps_other_handlers_and_never_writes_to_a_closed_stream(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`gengate serve` run in-process (an embedding application, a test) configures logging next to
    the handlers already there, and writes to stderr as it is at each record: a capture that was
    closed since does not turn every later line into "I/O operation on closed file"."""
    import io
    import logging

    from gengate.logs import configure_logging

    root = logging.getLogger()
    level = root.level
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stderr", captured)
    try:
        configure_logging("INFO", "text")
        configure_logging("INFO", "json")  # replaces its own handler, not others
        ours = [h for h in root.handlers if type(h).__name__ == "_StderrHandler"]
        assert len(ours) == 1 and caplog.handler in root.handlers
        logging.getLogger("gengate.test").warning("first")
        assert json.loads(captured.getvalue().splitlines()[-1])["message"] == "first"
        captured.close()
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        logging.getLogger("gengate.test").warning("second")  # no logging error
        assert "second" in caplog.text
    finally:
        for handler in [h for h in root.handlers if type(h).__name__ == "_StderrHandler"]:
            root.removeHandler(handler)
        root.setLevel(level)
