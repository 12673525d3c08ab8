"""The README's engine-settings example (issue 12) is a config gengate accepts, as written."""

from __future__ import annotations

from pathlib import Path

import yaml
from gengate.config import parse_config

README = Path(__file__).resolve().parents[2] / "README.md"


def test_engine_settings_example_parses() -> None:
    section = README.read_text().split("### Engine settings", 1)[1]
    example = section.split("```yaml", 1)[1].split("```", 1)[0]
    config = parse_config(yaml.safe_load(example), source="README.md")
    by_name = {m.name: m.options.model_dump(exclude_defaults=True) for m in config.models}
    assert by_name["llama"]["n_gpu_layers"] == -1 and by_name["llama"]["chat_format"] == "llama-3"
    assert by_name["qwen"]["device_map"] == "auto" and by_name["qwen"]["revision"] == "main"
    assert by_name["mistral"]["extra_engine_args"] == {"block_size": 32, "swap_space": 8}
