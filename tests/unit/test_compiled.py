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
BUILT = compiled.up_to_date()


def _which_files(root: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """Each compiled module's file as a fresh interpreter imports it with `root` first on the path."""
    code = (
        "import json, importlib, gengate.compiled as c;"
        "print(json.dumps({m: importlib.import_module(m).__file__ for m in c.MODULES}))"
    )
    inherited = {k: v for k, v in os.environ.items() if k != compiled.OFF_VARIABLE}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**inherited, **(env or {}), "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    )
    return json.loads(done.stdout)


def _from_source(files: dict[str, str]) -> bool:
    return all(f.endswith(".py") for f in files.values())


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the built server tree (sources, extensions, stamp) to edit."""
    if not BUILT:
        pytest.skip("not compiled here (no C compiler at set-up): nothing to guard")
    root = tmp_path_factory.mktemp("server")
    shutil.copytree(SERVER / "gengate", root / "gengate", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_a_fresh_build_is_imported(copy: Path) -> None:
    files = _which_files(copy)
    build = copy / "gengate" / compiled.BUILD_DIR
    assert all(Path(files[m]).parent == build for m in compiled.MODULES), files


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


def test_a_checkout_without_the_finder_imports_python(copy: Path) -> None:
    """A checkout from before gengate.compiled (bisecting, say) keeps the ignored build folder,
    but Python's own import never looks there: no build shadows its sources."""
    init = copy / "gengate" / "__init__.py"
    original = init.read_text()
    init.write_text("")
    try:
        code = (
            "import gengate.metrics.families as f, gengate.callers.limits as l; print(f.__file__, l.__file__)"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(copy)},
            capture_output=True, text=True, check=True, cwd=copy,
        )  # fmt: skip
        assert all(name.endswith(".py") for name in done.stdout.split()), done.stdout
    finally:
        init.write_text(original)


def test_no_stamp_or_another_interpreter_means_python(copy: Path) -> None:
    stamp = copy / "gengate" / compiled.BUILD_DIR / compiled.STAMP_NAME
    saved = stamp.read_text()
    try:
        stamp.unlink()
        assert _from_source(_which_files(copy))
        stamp.write_text(json.dumps({**json.loads(saved), "python": "cpython-99"}))
        assert _from_source(_which_files(copy))
    finally:
        stamp.write_text(saved)


def test_a_build_without_its_runtime_library_means_python(copy: Path) -> None:
    """The extensions import the runtime library they share: without it they are not used,
    rather than failing to import."""
    (runtime,) = (copy / "gengate" / compiled.BUILD_DIR).glob("*__mypyc*")
    moved = runtime.rename(copy / runtime.name)
    try:
        assert _from_source(_which_files(copy))
    finally:
        moved.rename(runtime)


def test_switched_off(copy: Path) -> None:
    assert _from_source(_which_files(copy, {compiled.OFF_VARIABLE: "0"}))


def test_this_run_uses_the_build() -> None:
    """With every extra required (the test command, CI), set-up must have compiled the hot paths
    and this run must import them: else the suite would test code the server does not run."""
    if os.environ.get("GENGATE_REQUIRE_EXTRAS") != "1" and not BUILT:
        pytest.skip("not compiled here")
    if compiled.switched_off():
        pytest.skip(f"{compiled.OFF_VARIABLE}=0")
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
