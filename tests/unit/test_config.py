"""Config parsing: strict keys, errors naming file, entry and key."""

from __future__ import annotations

from pathlib import Path

import pytest
from gengate.config import default_config, load_config, parse_config
from gengate.errors import ConfigError


def test_loads_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "gengate.yaml"
    path.write_text("models:\n  - name: e\n    backend: scripted\n    text: hi\n    max_concurrency: 2\n")
    config = load_config(path)
    assert config.models[0].name == "e" and config.models[0].max_concurrency == 2
    assert config.models[0].options.text == "hi"  # type: ignore[attr-defined]


def test_unknown_key_names_file_entry_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("models:\n  - name: e\n    backend: scripted\n    tempurature: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert str(path) in message and "models[0] (e)" in message and "tempurature" in message


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({}, "'models' must be a non-empty list"),
        ({"models": [], "x": 1}, "unknown top-level key"),
        ({"models": [{"backend": "scripted"}]}, "'name' is required"),
        ({"models": [{"name": "a"}]}, "'backend' is required"),
        ({"models": [{"name": "a", "backend": "nope"}]}, "unknown backend 'nope'"),
        ({"models": [{"name": "a", "backend": "scripted"}] * 2}, "duplicate model name"),
        ({"models": [{"name": "a", "backend": "scripted", "max_concurrency": 0}]}, "positive integer"),
        ({"models": [{"name": "a", "backend": "scripted", "latency_s": -1}]}, "latency_s"),
        (
            {"models": [{"name": "a", "backend": "scripted"}], "server": {"prot": 1}},
            "server: prot: unknown key",
        ),
        ({"models": [{"name": "a", "backend": "scripted"}], "server": {"port": "x"}}, "server: port"),
        ({"models": [{"name": "a", "backend": "scripted"}], "server": {"tls_cert_file": "c"}}, "go together"),
    ],
)
def test_config_errors(data: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_config(data, source="cfg.yaml")


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


def test_default_serves_tiny_on_llamacpp() -> None:
    config = default_config(env={})
    assert config.models[0].name == "tiny"
    assert config.models[0].backend == "llamacpp"


def test_default_adds_a_model_per_provider_key_in_the_environment() -> None:
    secret = "sk-test-abcdefghijklmnop"
    config = default_config(env={"OPENAI_API_KEY": secret, "ANTHROPIC_API_KEY": "sk-ant-test-123456"})
    by_name = {m.name: m for m in config.models}
    assert by_name["openai"].backend == "openai" and by_name["anthropic"].backend == "anthropic"
    assert "tiny" in by_name
    assert secret not in repr(config)  # the entry names the variable, never the key
