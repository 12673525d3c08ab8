"""GENGATE_REQUIRE_EXTRAS=1 (set by scripts/test): a missing extra fails the run instead of skipping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def strict_importorskip(original: Callable[..., Any]) -> Callable[..., Any]:
    """pytest.importorskip that fails instead of skipping: under GENGATE_REQUIRE_EXTRAS=1 (set by
    scripts/test) a broken install of an extra cannot pass as a green run with skips."""

    def importorskip(modname: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(modname, *args, **kwargs)
        except pytest.skip.Exception as exc:
            pytest.fail(f"GENGATE_REQUIRE_EXTRAS=1 and {modname} cannot be imported: {exc}", pytrace=False)

    return importorskip
