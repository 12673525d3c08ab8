"""The README's capability table says what the backends declare (and ListModels reports)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from gengate.domain import ConstraintKind, Enforcement, Modality
from gengate.registry import KINDS, backend_class

README = Path(__file__).resolve().parents[2] / "README.md"
COLUMNS = [
    ConstraintKind.JSON_SCHEMA,
    ConstraintKind.JSON_OBJECT,
    ConstraintKind.CHOICE,
    ConstraintKind.REGEX,
    ConstraintKind.GRAMMAR,
]


def readme_rows() -> dict[str, list[str]]:
    text = README.read_text()
    table = text.split("<!-- capabilities:start -->")[1].split("<!-- capabilities:end -->")[0]
    rows: dict[str, list[str]] = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def default_options(cls: Any) -> Any:
    """Options a backend of this kind can be built with, without network or a model on disk."""
    fields = cls.Options.model_fields
    values: dict[str, Any] = {}
    if "tiny" in fields:
        return cls.Options(tiny=True)
    for key, value in (("model", "m"), ("api_key", "sk-test"), ("base_url", "http://127.0.0.1:9")):
        if key in fields:
            values[key] = value
    return cls.Options(**values)


ROWS = readme_rows()


def test_every_served_kind_has_a_row() -> None:
    # Composite kinds have no row: their capabilities derive from their members'.
    served = {kind for kind, spec in KINDS.items() if spec.role != "composite"}
    assert set(ROWS) == served - {"vllm"}  # vllm needs a GPU stack to import


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_row_matches_declared_capabilities(kind: str) -> None:
    cls = backend_class(kind)
    caps = cls(kind, default_options(cls)).capabilities
    cells = ROWS[kind]
    for column, cell in zip(COLUMNS, cells[:5], strict=True):
        declared = caps.constraints.get(column)
        expected = None if cell == "—" else Enforcement(cell)
        assert declared == expected, f"{kind} {column.value}: README says {cell}, backend declares {declared}"
    syntaxes = {s.strip() for s in re.split(r",", cells[5]) if s.strip()}
    assert syntaxes == {s.value for s in caps.grammar_syntaxes}, kind
    assert (cells[6] == "yes") == caps.logprobs, kind
    assert (cells[7] == "yes") == (Modality.IMAGE in caps.input_modalities), kind
    assert (cells[8] == "yes") == caps.raw_prompt, f"{kind}: README's magpie column"
