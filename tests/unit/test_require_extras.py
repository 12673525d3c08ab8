"""GENGATE_REQUIRE_EXTRAS=1 turns a missing extra into a failure, not a skip."""

from __future__ import annotations

import pytest
from require_extras import strict_importorskip


def test_a_missing_module_fails_instead_of_skipping() -> None:
    strict = strict_importorskip(pytest.importorskip)
    with pytest.raises(pytest.fail.Exception, match="no_such_extra_module"):
        strict("no_such_extra_module")
    assert strict("json").dumps([1]) == "[1]"
