"""The mypyc-compiled hot paths (gengate.compiled): a build is imported only while its source is
the one it was built from, GENGATE_COMPILED=0 turns it off, and the test run uses the build
scripts/setup made (so the suite tests the code the server runs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gengate.compiled as compiled
import pytest
from gengate.metrics.families import Family, Metrics

SERVER = Path(compiled.__file__).resolve().parent.parent
BUILT = all(compiled.compiled_path(module) is not None for module in compiled.MODULES)


def _which_files(root: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """Each compiled module's file as a fresh interpreter imports it with `root` first on the path."""
    code = (
        "import json, importlib, gengate.compiled as c;"
        "print(json.dumps({m: importlib.import_module(m).__file__ for m in c.MODULES}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **(env or {}), "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    )
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the built server tree (sources, extensions, stamp) to edit."""
    if not BUILT:
        pytest.skip("not compiled here (no C compiler at set-up): nothing to guard")
    root = tmp_path_factory.mktemp("server")
    shutil.copytree(SERVER / "gengate", root / "gengate", ignore=shutil.ignore_patterns("__pycache__"))
    for shared in SERVER.glob("*__mypyc*"):
        shutil.copy2(shared, root / shared.name)
    return root


def test_a_fresh_build_is_imported(copy: Path) -> None:
    files = _which_files(copy)
    assert all(not files[m].endswith(".py") for m in compiled.MODULES), files


def test_an_edited_source_is_imported_from_python(copy: Path) -> None:
    source = compiled.source_of("gengate.metrics.families", copy)
    original = source.read_text()
    source.write_text(original + "\nEDITED = True\n")
    try:
        files = _which_files(copy)
        assert files["gengate.metrics.families"] == str(source)  # the edit, not the stale build
        assert not files["gengate.callers.limits"].endswith(".py")  # its build still matches
    finally:
        source.write_text(original)


def test_no_stamp_or_another_interpreter_means_python(copy: Path) -> None:
    stamp = copy / "gengate" / compiled.STAMP.name
    saved = stamp.read_text()
    try:
        stamp.unlink()
        assert all(f.endswith(".py") for f in _which_files(copy).values())
        stamp.write_text(json.dumps({**json.loads(saved), "python": "cpython-99"}))
        assert all(f.endswith(".py") for f in _which_files(copy).values())
    finally:
        stamp.write_text(saved)


def test_a_copy_without_the_runtime_library_means_python(copy: Path) -> None:
    """A copy of the package alone (mutation testing's, a wheel's) lacks the shared library the
    extensions import: they are not used, rather than failing to import."""
    (runtime,) = copy.glob("*__mypyc*")
    moved = runtime.rename(copy / "gengate" / runtime.name)
    try:
        assert all(f.endswith(".py") for f in _which_files(copy).values())
    finally:
        moved.rename(runtime)


def test_switched_off(copy: Path) -> None:
    files = _which_files(copy, {compiled.OFF_VARIABLE: "0"})
    assert all(f.endswith(".py") for f in files.values())


def test_this_run_uses_the_build() -> None:
    """With every extra required (the test command, CI), set-up must have compiled the hot paths
    and this run must import them: else the suite would test code the server does not run."""
    if os.environ.get("GENGATE_REQUIRE_EXTRAS") != "1" and not BUILT:
        pytest.skip("not compiled here")
    import gengate.callers.limits
    import gengate.metrics.families

    assert compiled.fresh_modules() == frozenset(compiled.MODULES)
    assert compiled.status().startswith("compiled with mypyc")
    assert not gengate.metrics.families.__file__.endswith(".py")
    assert not gengate.callers.limits.__file__.endswith(".py")


def test_metrics_lists_every_family() -> None:
    """Metrics.families is written out (a compiled class has no __dict__ to find them in)."""
    metrics = Metrics()
    found = [getattr(metrics, name) for name in dir(metrics) if isinstance(getattr(metrics, name), Family)]
    assert len(found) == len(metrics.families) == len({id(f) for f in metrics.families})
    assert {id(f) for f in found} == {id(f) for f in metrics.families}
