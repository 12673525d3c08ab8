"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gengate.models.tiny import TinyModelPaths, build_tiny_model
from require_extras import strict_importorskip

if os.environ.get("GENGATE_REQUIRE_EXTRAS") == "1":
    pytest.importorskip = strict_importorskip(pytest.importorskip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModelPaths:
    """The tiny local model (HF folder + GGUF), built once per session into $GENGATE_CACHE or a tmp dir."""
    cache = os.environ.get("GENGATE_CACHE")
    base = Path(cache).expanduser() if cache else tmp_path_factory.mktemp("gengate-cache")
    return build_tiny_model(base / "tiny")
