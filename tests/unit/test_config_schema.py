"""`gengate config schema`, `gengate config check` and the GENGATE_SERVER_* overrides: the schema
accepts every config the project documents and refuses what the loader refuses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from gengate.cli import main
from gengate.config import load_config, parse_config, read_yaml, server_overrides
from gengate.config_schema import config_schema
from gengate.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


# Models that README fragments (a `callers:` or `server:` block, a composite's entries) refer to.
STUB_MODELS = [{"name": n, "backend": "scripted"} for n in ("tiny", "gpt", "claude", "qwen")]


def documented_configs() -> list[tuple[str, Any, bool]]:
    """Every config the project ships or shows: (where, config, whole). README fragments get
    stand-in models; a whole config (with its own `models:`) must also load."""
    conformance = ROOT / "clients/conformance/config.yaml"
    found = [("clients/conformance/config.yaml", read_yaml(conformance.read_text()), True)]
    readme = (ROOT / "README.md").read_text()
    for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", readme, flags=re.S)):
        data = read_yaml(block)
        if isinstance(data, list):  # model entries
            found.append((f"README.md yaml block {i}", {"models": data + STUB_MODELS}, True))
        elif isinstance(data, dict):
            whole = "models" in data
            found.append(
                (f"README.md yaml block {i}", data if whole else {**data, "models": STUB_MODELS}, whole)
            )
    return found


@pytest.mark.parametrize(
    ("where", "data", "whole"), documented_configs(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_documented_config_matches_the_schema(
    validator: jsonschema.Draft202012Validator, where: str, data: Any, whole: bool
) -> None:
    problems = [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(data)]
    assert problems == [], where
    if whole:
        parse_config(data, source=where)


def test_the_readme_shows_several_configs() -> None:
    configs = documented_configs()
    assert len(configs) >= 6 and sum(whole for _, _, whole in configs) >= 3


def test_yaml_1_1_booleans_stay_words() -> None:
    """`on:` (a fallback's codes) is a key, not True; `yes` is not a boolean either."""
    assert read_yaml("on: [UNAVAILABLE]\nx: yes\ny: true\n") == {"on": ["UNAVAILABLE"], "x": "yes", "y": True}


BASE = {"name": "m", "backend": "scripted"}


@pytest.mark.parametrize(
    "entry",
    [
        {**BASE, "tempurature": 1},  # a typo of a backend option
        {**BASE, "max_concurrency": 0},
        {**BASE, "max_concurrency": True},
        {**BASE, "isolation": "thread"},
        {**BASE, "devices": "all"},
        {**BASE, "share_devices": "yes"},
        {**BASE, "latency_s": -1},
        {"name": "m", "backend": "no-such-kind"},
        {"backend": "scripted"},
    ],
)
def test_what_the_loader_refuses_the_schema_refuses(
    validator: jsonschema.Draft202012Validator, entry: dict[str, Any]
) -> None:
    data = {"models": [entry]}
    assert not validator.is_valid(data)
    with pytest.raises(ConfigError):
        parse_config(data)


def test_server_and_callers_sections_are_described(validator: jsonschema.Draft202012Validator) -> None:
    good = {
        "models": [BASE],
        "server": {"port": 50052, "metrics": {"port": 9090}, "limits": {}},
        "callers": [{"name": "team-a", "token_env": "TEAM_A_TOKEN", "models": ["m"], "priority": 5}],
    }
    assert validator.is_valid(good)
    assert not validator.is_valid({**good, "server": {"prot": 1}})
    assert not validator.is_valid({**good, "callers": [{"name": "team-a", "rpm": 5}]})
    assert not validator.is_valid({**good, "extra": 1})


def test_config_schema_prints_it_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    kinds = {
        branch["properties"]["backend"]["const"]
        for branch in printed["properties"]["models"]["items"]["oneOf"]
    }
    assert {"scripted", "llamacpp", "openai", "anthropic", "fallback"} <= kinds


def test_config_check_validates_without_serving(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("models:\n  - name: m\n    backend: scripted\n")
    assert main(["config", "check", str(good)]) == 0
    assert "ok: 1 model(s) (scripted)" in capsys.readouterr().out

    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: m\n    backend: scripted\n    cpu_threads: 2\n")
    assert main(["config", "check", str(bad)]) == 2
    assert "'cpu_threads' applies to" in capsys.readouterr().err, "the start-up checks run too"


def test_environment_overrides_the_server_section(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "models:\n  - name: m\n    backend: scripted\nserver:\n  port: 1000\n  metrics: {host: 0.0.0.0}\n"
    )
    env = {
        "GENGATE_SERVER_PORT": "2000",
        "GENGATE_SERVER_METRICS__PORT": "9100",
        "GENGATE_SERVER_REQUEST_TIMEOUT_S": "2.5",
        "GENGATE_SERVER_STATE_FAIL_CLOSED": "true",
        "GENGATE_LOG_LEVEL": "DEBUG",  # another gengate variable: not a server key
    }
    server = load_config(path, env=env).server
    assert server.port == 2000 and server.request_timeout_s == 2.5 and server.state_fail_closed is True
    assert server.metrics.port == 9100 and server.metrics.host == "0.0.0.0", (
        "a nested key merges, not replaces"
    )
    assert load_config(None, env={"GENGATE_SERVER_PORT": "2001"}).server.port == 2001


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"GENGATE_SERVER_PROT": "1"}, "prot: unknown key"),
        ({"GENGATE_SERVER_PORT": "many"}, "port"),
        ({"GENGATE_SERVER_PORT": "[1"}, "GENGATE_SERVER_PORT: not a valid YAML value"),
    ],
)
def test_a_bad_override_names_its_variable(tmp_path: Path, env: dict[str, str], fragment: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - name: m\n    backend: scripted\n")
    with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
        load_config(path, env=env)
    assert next(iter(env)) in str(caught.value)


def test_override_paths() -> None:
    assert server_overrides({"GENGATE_SERVER_JOBS__STORE": "postgresql://db/x", "OTHER": "1"}) == {
        "jobs": {"store": "postgresql://db/x"}
    }
    assert server_overrides({"GENGATE_SERVER_REQUEST_TIMEOUT_S": ""}) == {"request_timeout_s": None}
