"""The `gengate` command end to end, as separate processes: serve, generate, models, demo."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="the embedded default serves the tiny model on llama.cpp")

GENGATE = [sys.executable, "-m", "gengate"]


def gengate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GENGATE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """`gengate serve --port 0` in a child process; yields the address it prints."""
    proc = subprocess.Popen(
        [*GENGATE, "serve", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    address = None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        match = re.search(r"gengate serving on (\S+:\d+)", line)
        if match:
            address = match.group(1)
            break
    assert address, "".join(seen)
    yield address
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_generate_and_models_against_a_served_process(served: str) -> None:
    result = gengate(
        "generate",
        "--address",
        served,
        "--model",
        "tiny",
        "--prompt",
        "Date:",
        "--regex",
        "[0-9]{4}-[0-9]{2}",
    )
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}\n", result.stdout)

    base = ["generate", "--address", served, "--model", "tiny"]
    result = gengate(*base, "--prompt", "x", "--choice", "a", "--choice", "b", "--n", "2", "--json")
    data = json.loads(result.stdout)
    assert [g["text"] in ("a", "b") for g in data["generations"]] == [True, True]
    assert data["enforcement"] != "ENFORCEMENT_NONE"

    result = gengate("generate", "--address", served, "--model", "tiny", "--prompt", "x", "--max-tokens", "0")
    assert result.returncode == 1 and result.stderr.startswith("INVALID_ARGUMENT: ")
    assert "stopping.max_tokens" in result.stderr

    result = gengate(*base, "--prompt", "Hi", "--max-tokens", "6", "--stream", "--json")
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    assert "start" in frames[0] and "end" in frames[-1]

    result = gengate("models", "--address", served)
    assert result.returncode == 0 and result.stdout.splitlines()[1].startswith("tiny ")


def test_serve_refuses_a_bad_config(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("models:\n  - name: x\n    backend: llamacpp\n    colour: blue\n")
    result = gengate("serve", "--config", str(config), "--port", "0")
    assert result.returncode == 2 and "colour" in result.stderr


def test_demo_builds_serves_and_shows_each_kind(tmp_path: Path) -> None:
    env = {**os.environ, "GENGATE_CACHE": str(tmp_path)}
    result = subprocess.run([*GENGATE, "demo"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"building tiny model into {tmp_path / 'tiny'}" in out
    assert re.search(r"City\(name='.*', population=\d+, country_code='[A-Z]{2}'\)", out)
    assert re.search(r"^\([0-9]{3}\) [0-9]{3}-[0-9]{4}", out, re.MULTILINE)
    assert re.search(r"^(positive|negative|neutral)$", out, re.MULTILINE)
    assert "[1] NOT_FOUND" in out and out.rstrip().endswith("server stopped")


def test_generate_magpie_prints_the_written_conversation(served: str) -> None:
    common = ["generate", "--address", served, "--model", "tiny", "--max-tokens", "4", "--seed", "5"]
    result = gengate(*common, "--magpie", "qwen2", "--system", "Ask about maps.", "--turns", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":", 1)[0] for line in lines if line.startswith(("user:", "assistant:"))] == [
        "user", "assistant", "user", "assistant",
    ]  # fmt: skip
    as_json = json.loads(gengate(*common, "--magpie", "qwen2", "--json").stdout)
    assert [t["role"] for t in as_json["generations"][0]["conversation"]] == ["ROLE_USER", "ROLE_ASSISTANT"]
    refused = gengate(*common, "--magpie", "llama3")
    assert refused.returncode != 0 and "MAGPIE_TOKENS_MISSING" in refused.stderr + refused.stdout
    misuse = gengate(*common, "--prompt", "hi", "--turns", "2")
    assert misuse.returncode != 0 and "--magpie" in misuse.stderr


def test_generate_with_tools_prints_the_calls(served: str, tmp_path: Path) -> None:
    """--tools FILE and --tool-choice reach the server; the calls print as `call NAME(ARGS)` lines,
    and --json gives generations[i].toolCalls[j].{id, name, arguments} (arguments parsed)."""
    weather = {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    }
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([weather, {"name": "get_time"}]))
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": "Weather in Paris?"}]))
    common = ["generate", "--address", served, "--model", "tiny", "--messages", str(messages)]
    common += ["--tools", str(tools), "--max-tokens", "60", "--seed", "3"]
    result = gengate(*common, "--tool-choice", "get_weather", "--json")
    assert result.returncode == 0, result.stderr
    generation = json.loads(result.stdout)["generations"][0]
    assert generation["finishReason"] == "FINISH_REASON_TOOL_CALLS"
    for call in generation["toolCalls"]:
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        assert isinstance(call["arguments"]["city"], str) and len(call["arguments"]["city"]) <= 8
    text = gengate(*common, "--tool-choice", "required")
    assert text.returncode == 0, text.stderr
    assert re.search(r"^call (get_weather|get_time)\(\{.*\}\) id=call_\w+$", text.stdout, re.MULTILINE)
    misuse = gengate(
        "generate", "--address", served, "--model", "tiny", "--prompt", "hi", "--tool-choice", "auto"
    )
    assert misuse.returncode == 2 and "--tools" in misuse.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "f", "parameter": {}}]))
    refused = gengate(
        "generate", "--address", served, "--model", "tiny", "--prompt", "hi", "--tools", str(bad)
    )
    assert refused.returncode == 2 and "unknown keys ['parameter']" in refused.stderr
