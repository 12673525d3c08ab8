"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gengate.models.tiny import TinyModelPaths, build_tiny_model


def strict_importorskip(original: Callable[..., Any]) -> Callable[..., Any]:
    """pytest.importorskip that fails instead of skipping: under GENGATE_REQUIRE_EXTRAS=1 (set by
    scripts/test) a broken install of an extra cannot pass as a green run with skips."""

    def importorskip(modname: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(modname, *args, **kwargs)
        except pytest.skip.Exception as exc:
            pytest.fail(f"GENGATE_REQUIRE_EXTRAS=1 and {modname} cannot be imported: {exc}", pytrace=False)

    return importorskip


if os.environ.get("GENGATE_REQUIRE_EXTRAS") == "1":
    pytest.importorskip = strict_importorskip(pytest.importorskip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModelPaths:
    """The tiny local model (HF folder + GGUF), built once per session into $GENGATE_CACHE or a tmp dir."""
    cache = os.environ.get("GENGATE_CACHE")
    base = Path(cache).expanduser() if cache else tmp_path_factory.mktemp("gengate-cache")
    return build_tiny_model(base / "tiny")
