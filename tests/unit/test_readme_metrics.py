"""README "Metrics" documents every family the server exports, with its labels, and its config
example is one the server takes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from gengate.config import parse_config
from gengate.metrics import catalogue

README = Path(__file__).resolve().parents[2] / "README.md"


def section() -> str:
    return README.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]


def test_every_family_is_in_the_table_with_its_type_and_labels() -> None:
    rows: dict[str, tuple[str, set[str]]] = {}
    for line in section().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        labels = set(re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", cells[2])))  # not the values
        for name in re.findall(r"`([a-z_*]+)`", cells[0]):
            rows[name] = (cells[1], labels)
    for name, (kind, labels) in catalogue().items():
        if name.startswith("process_"):
            assert "process_*" in rows
            continue
        shown = name + "_total" if kind == "counter" else name
        assert shown in rows, f"{shown} is not in README's Metrics table"
        assert rows[shown][0] == kind, shown
        assert rows[shown][1] == set(labels), (shown, rows[shown][1], labels)


def test_the_config_example_is_valid() -> None:
    example = section().split("```yaml", 1)[1].split("```", 1)[0]
    config = parse_config({"models": [{"name": "tiny", "backend": "scripted"}], **yaml.safe_load(example)})
    assert (config.server.metrics.port, config.server.metrics.host) == (9464, "0.0.0.0")
    assert config.server.metrics.prices["tiny"].cost(1_000_000, 1_000_000) == pytest.approx(0.75)
