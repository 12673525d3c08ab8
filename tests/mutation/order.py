"""A pytest plugin for scripts/mutation only (`-p tests.mutation.order` in [tool.mutmut]): a mutant's
unit tests run before its integration tests. mutmut stops at the first failing test, and most
mutants fail a unit test, so a mutant is killed in about a second instead of after the servers
and worker processes of the slower tests have started. The order within each group is kept."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: 0 if item.nodeid.startswith("tests/unit/") else 1)
