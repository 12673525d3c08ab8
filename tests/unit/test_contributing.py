"""CONTRIBUTING.md stays true: every file it names exists, and every module it names holds the
names it points to."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "CONTRIBUTING.md").read_text()


def _named_paths() -> list[str]:
    paths = []
    for quoted in re.findall(r"`([^`]+)`", TEXT):
        first = quoted.split()[0]
        if "/" in first and "<" not in first and not first.startswith(("http", "gengate[")):
            paths.append(first.rstrip("/"))
    return paths


def test_it_names_files_and_every_one_exists() -> None:
    paths = _named_paths()
    assert len(paths) > 30
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert missing == []


def test_the_names_it_points_to_are_where_it_says() -> None:
    where = {
        "server/gengate/providers/openai.py": ["class OpenAICompatibleBackend", "class TogetherBackend"],
        "server/gengate/registry.py": ["def _openai_family", "def _provider", "def _engine", "KINDS"],
        "tests/providers/test_openai.py": ["FAMILY = [", "JSON_SCHEMA_ENFORCEMENT = {"],
        "README.md": ["<!-- capabilities:start -->", "<!-- capabilities:end -->"],
        "server/gengate/engines/base.py": ["def engine_capabilities", "def output_room", "def stream_start"],
        "proto/gengate/v1/types.proto": ["message StructuredOutput", "enum ConstraintKind"],
    }
    for path, names in where.items():
        text = (ROOT / path).read_text()
        assert [n for n in names if n not in text] == [], path
