"""The per-call hot paths compiled to C with mypyc (caller quotas and metric recording), and the
guard that only a compiled module built from the source beside it is ever imported.

`gengate compile` (scripts/setup runs it) compiles MODULES in place, next to their
sources, and writes STAMP: each source's SHA-256 as it was compiled. On import of gengate, a
compiled module whose source no longer matches its stamp (edited, mutated, checked out anew) is
imported from its .py instead, so an edit is never shadowed by a stale build. Without a compiler,
or with GENGATE_COMPILED=0, everything runs as plain Python: the same code, ~25% more of the
server's own instructions per call on the operations path (bench/README "Operations overhead").
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# Modules compiled: pure Python with no import-time side effects that mypyc changes, typed
# throughout, never subclassed or patched from outside (native classes refuse both).
MODULES = ("gengate.metrics.families", "gengate.callers.limits")
ROOT = Path(__file__).resolve().parent.parent  # the directory holding the gengate package
STAMP = Path(__file__).resolve().parent / "compiled.json"
OFF_VARIABLE = "GENGATE_COMPILED"  # "0": import every module from its source


def source_of(module: str, root: Path = ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compiled_path(module: str, root: Path = ROOT) -> Path | None:
    """The module's extension next to its source, when one was built for this interpreter."""
    source = source_of(module, root)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = source.with_suffix(suffix)
        if candidate.exists():
            return candidate
    return None


def fresh_modules(root: Path = ROOT, stamp: Path = STAMP) -> frozenset[str]:
    """The modules whose compiled form may be imported: built, with their shared runtime library
    (a copy of the package without it cannot import them), and built from the source that is
    beside it now (by the stamp). Empty when compiling is switched off or nothing was built."""
    if os.environ.get(OFF_VARIABLE, "1") == "0":
        return frozenset()
    try:
        built = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return frozenset()
    if not isinstance(built, dict) or built.get("python") != sys.implementation.cache_tag:
        return frozenset()
    sources = built.get("sources", {})
    runtime = built.get("runtime")  # the modules' shared mypyc library, beside the gengate package
    if not isinstance(runtime, str) or not any(
        (root / f"{runtime}{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES
    ):
        return frozenset()
    fresh = set()
    for module in MODULES:
        source = source_of(module, root)
        if compiled_path(module, root) is None or not source.exists():
            continue
        if sources.get(module) == _digest(source):
            fresh.add(module)
    return frozenset(fresh)


class _SourceWhereStale(importlib.abc.MetaPathFinder):
    """Imports a compiled module from its .py unless its build is fresh (the default finder
    prefers an extension module to a source file in the same directory)."""

    def __init__(self, root: Path, fresh: frozenset[str]) -> None:
        self.root = root
        self.fresh = fresh

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES or fullname in self.fresh:
            return None
        return importlib.util.spec_from_file_location(fullname, source_of(fullname, self.root))


def install(root: Path = ROOT) -> frozenset[str]:
    """Puts the guard first on sys.meta_path (once); the modules that will import compiled."""
    for finder in sys.meta_path:
        if isinstance(finder, _SourceWhereStale):
            return finder.fresh
    fresh = fresh_modules(root, root / "gengate" / STAMP.name)
    if len(fresh) < len(MODULES):  # nothing to guard when every build is fresh
        sys.meta_path.insert(0, _SourceWhereStale(root, fresh))
    return fresh


def status() -> str:
    """What runs, for the server's start-up line: which hot paths are compiled, or why none."""
    if os.environ.get(OFF_VARIABLE, "1") == "0":
        return f"plain Python ({OFF_VARIABLE}=0)"
    fresh = install()
    if not fresh:
        return "plain Python (not compiled, or compiled from other sources: gengate compile)"
    stale = [name for name in MODULES if name not in fresh]
    line = f"compiled with mypyc: {', '.join(sorted(fresh))}"
    return f"{line}; plain Python (sources changed since): {', '.join(stale)}" if stale else line


def build(root: Path = ROOT) -> None:
    """Compiles MODULES in place under `root` with mypyc and stamps them; CalledProcessError
    (its output printed) when mypyc or the C compiler fails. Imported modules' types are not
    followed (`--follow-imports=skip`: ~15 s instead of ~5 min; mypy checks them in CI)."""
    sources = [source_of(module, root) for module in MODULES]
    stamp = root / "gengate" / STAMP.name
    stamp.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="gengate-mypyc-") as work:
        # mypyc builds in ./build: run where that is a scratch directory, then copy the results.
        package = root / "gengate"
        for source in sources:  # each module and the packages that name it
            packages = [p / "__init__.py" for p in source.parents if p.is_relative_to(package)]
            for package_file in (source, *packages):
                copy = Path(work, package_file.relative_to(root))
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(package_file, copy)
        command = [sys.executable, "-m", "mypyc", "--follow-imports=skip", "--ignore-missing-imports"]
        command += [str(source.relative_to(root)) for source in sources]
        done = subprocess.run(command, cwd=work, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
            done.check_returncode()
        runtime = None
        for built in Path(work).rglob("*.so"):
            relative = built.relative_to(work)
            if relative.parts[0] == "build":
                continue
            if len(relative.parts) == 1:
                runtime = relative.name.split(".", 1)[0]
            target = root / relative
            target.unlink(missing_ok=True)  # a new inode: a running process keeps its mapping
            shutil.copy2(built, target)
    digests = {module: _digest(source) for module, source in zip(MODULES, sources, strict=True)}
    record = {"python": sys.implementation.cache_tag, "runtime": runtime, "sources": digests}
    stamp.write_text(json.dumps(record, indent=2) + "\n")


def main() -> int:
    """`gengate compile`: 0 when compiled, 1 (saying why) when not."""
    try:
        build()
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"gengate.compiled: not compiled ({exc}); the server runs as plain Python", file=sys.stderr)
        return 1
    print(f"gengate.compiled: compiled {', '.join(MODULES)}")
    return 0
