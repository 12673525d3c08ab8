"""The teams' tokens are in the environment of every test here."""

from __future__ import annotations

import pytest
from teams import TOKENS


@pytest.fixture(autouse=True)
def team_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable, token in TOKENS.items():
        monkeypatch.setenv(variable, token)
