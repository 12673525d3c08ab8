"""The README's distilabel table names real backend kinds, real config keys of each, and the seed
support each kind declares. (That every distilabel LLM class has a row is checked where distilabel
is installed: tests/distilabel.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gengate.config import option_keys
from gengate.registry import KINDS, backend_class
from test_readme_capabilities import default_options

README = Path(__file__).resolve().parents[2] / "README.md"


def parity_rows() -> dict[str, list[str]]:
    table = README.read_text().split("<!-- distilabel:start -->")[1].split("<!-- distilabel:end -->")[0]
    rows: dict[str, list[str]] = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


ROWS = parity_rows()
SERVED = {name: cells for name, cells in ROWS.items() if not cells[0].startswith("not yet")}


def test_rows_not_served_yet_name_their_issue() -> None:
    for name, cells in ROWS.items():
        if name not in SERVED:
            assert re.fullmatch(r"not yet \(issue \d+\)", cells[0]), name


@pytest.mark.parametrize("llm", sorted(SERVED))
def test_row_names_a_kind_and_its_settings(llm: str) -> None:
    kind, settings, _ = SERVED[llm]
    assert kind in KINDS, f"{llm}: no backend kind {kind!r}"
    fields = option_keys(backend_class(kind).Options)
    keys = [key.split(":")[0] for key in re.findall(r"`([^`]+)`", settings)]
    assert keys, llm
    for key in keys:
        assert key in fields, f"{llm}: {kind} has no setting {key!r}"


@pytest.mark.parametrize("llm", sorted(SERVED))
def test_seed_column_matches_what_the_kind_declares(llm: str) -> None:
    kind, _, seed = SERVED[llm]
    if KINDS[kind].role == "composite":
        assert seed == "if all members do", llm  # composites: seed only if every member takes one
        return
    if kind == "vllm":  # needs a GPU stack to build (as in the capabilities table)
        assert seed == "yes"
        return
    cls = backend_class(kind)
    assert (seed == "yes") == cls(kind, default_options(cls)).capabilities.seed, llm
