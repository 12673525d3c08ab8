"""The per-call hot paths compiled to C with mypyc (caller quotas and metric recording), and the
finder that imports a compiled module only while it was built from the source beside it.

`gengate compile` (scripts/setup runs it) compiles MODULES into BUILD_DIR, a folder of the
package that Python's own import never searches, and writes its stamp there: each source's
SHA-256 as compiled. Importing gengate puts a finder first on sys.meta_path that imports a module
of MODULES from BUILD_DIR while its stamp matches its source, and leaves every other case to
Python's own import of the .py: an edited, mutated or newly checked-out source, a build for
another interpreter, GENGATE_COMPILED=0, or a checkout from before this module (which has no
finder and never looks in BUILD_DIR). Without a C compiler it all runs as plain Python: the same
code, ~26% more of the instructions operations add a call (bench/README "Operations overhead").

Compiled, the functions check their arguments' types at run time (a float or numpy integer where
`int` is annotated, a list for a tuple: TypeError), classes cannot be subclassed, and a method
patched from outside is not what compiled callers call: keep MODULES typed exactly as they are
called, and never patch them in tests.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# Modules compiled: typed throughout, no import-time work that mypyc changes, never subclassed.
MODULES = ("gengate.metrics.families", "gengate.callers.limits")
ROOT = Path(__file__).resolve().parent.parent  # the directory holding the gengate package
BUILD_DIR = "_compiled"  # inside the gengate package; gitignored
STAMP_NAME = "stamp.json"
OFF_VARIABLE = "GENGATE_COMPILED"  # "0": import every module from its source


def source_of(module: str, root: Path = ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def build_dir(root: Path = ROOT) -> Path:
    return root / "gengate" / BUILD_DIR


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _extension(directory: Path, name: str) -> Path | None:
    """The extension module `name` in `directory`, built for this interpreter."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = directory / f"{name}{suffix}"
        if candidate.exists():
            return candidate
    return None


def switched_off() -> bool:
    return os.environ.get(OFF_VARIABLE, "1") == "0"


def built_fresh(root: Path = ROOT) -> dict[str, Path]:
    """The extension of each module whose build is usable: the runtime library they share is
    there, the build is for this interpreter, and the module's source is the one compiled (by the
    stamp). The runtime library is under its own name; whatever is missing is simply absent."""
    directory = build_dir(root)
    try:
        stamp = json.loads((directory / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(stamp, dict) or stamp.get("python") != sys.implementation.cache_tag:
        return {}
    runtime = stamp.get("runtime")
    runtime_path = _extension(directory, runtime) if isinstance(runtime, str) else None
    if runtime_path is None:
        return {}
    sources = stamp.get("sources", {})
    fresh: dict[str, Path] = {}
    for module in MODULES:
        extension = _extension(directory, module)
        try:
            source = source_of(module, root).read_bytes()
        except OSError:
            continue
        if extension is not None and sources.get(module) == _digest(source):
            fresh[module] = extension
    if fresh:
        fresh[str(runtime)] = runtime_path
    return fresh


def _modules(extensions: dict[str, Path]) -> frozenset[str]:
    """The modules of MODULES among `extensions` (without the runtime library)."""
    return frozenset(name for name in extensions if name in MODULES)


def up_to_date(root: Path = ROOT) -> bool:
    """Whether every module has a fresh build (scripts/setup compiles when not), switched off or not."""
    return _modules(built_fresh(root)) == frozenset(MODULES)


def fresh_modules(root: Path = ROOT) -> frozenset[str]:
    """The modules of MODULES that import compiled in a process started now."""
    return frozenset() if switched_off() else _modules(built_fresh(root))


class _FreshBuilds:
    """Imports each fresh build from BUILD_DIR (and the runtime library they share); for every
    other module, and a module whose build is not fresh, Python's own finders (its .py). A
    meta path finder by protocol (importlib.abc would cost this import ~14 ms)."""

    def __init__(self, extensions: dict[str, Path]) -> None:
        self.extensions = extensions

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        extension = self.extensions.get(fullname)
        if extension is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(extension))
        return importlib.util.spec_from_file_location(fullname, extension, loader=loader)


def install(root: Path = ROOT) -> frozenset[str]:
    """Puts the finder first on sys.meta_path (once a process); the modules that import compiled."""
    for finder in sys.meta_path:
        if isinstance(finder, _FreshBuilds):
            return _modules(finder.extensions)
    extensions = {} if switched_off() else built_fresh(root)
    if extensions:
        sys.meta_path.insert(0, _FreshBuilds(extensions))
    return _modules(extensions)


def status() -> str:
    """What runs, for the server's start-up line: which hot paths are compiled, or why none."""
    if switched_off():
        return f"plain Python ({OFF_VARIABLE}=0)"
    fresh = install()
    if not fresh:
        return "plain Python (not compiled, or compiled from other sources: gengate compile)"
    stale = [name for name in MODULES if name not in fresh]
    line = f"compiled with mypyc: {', '.join(sorted(fresh))}"
    return f"{line}; plain Python (sources changed since): {', '.join(stale)}" if stale else line


def build(root: Path = ROOT) -> None:
    """Compiles MODULES with mypyc into BUILD_DIR under `root` and stamps them; CalledProcessError
    (its output printed) when mypyc or the C compiler fails, RuntimeError when it built no shared
    runtime library. One build at a time (a lock); the stamp names the sources as they were
    copied for compiling, written last, atomically. Imported modules' types are not followed
    (`--follow-imports=skip`: ~15 s instead of ~5 min; mypy checks them in CI)."""
    import subprocess
    import tempfile

    import portalocker  # these only to build: not on every import of gengate

    directory = build_dir(root)
    directory.mkdir(exist_ok=True)
    try:
        lock = portalocker.Lock(str(directory / ".lock"), timeout=600)
        lock.acquire()
    except portalocker.LockException as exc:
        raise RuntimeError("another gengate compile held the build folder for 10 minutes") from exc
    try:
        (directory / STAMP_NAME).unlink(missing_ok=True)
        with tempfile.TemporaryDirectory(prefix="gengate-mypyc-") as work:
            digests = _copy_sources(root, Path(work))
            # mypyc builds in ./build and leaves each extension beside its source: in `work`.
            command = [sys.executable, "-m", "mypyc", "--follow-imports=skip", "--ignore-missing-imports"]
            command += [str(source_of(module, Path("."))) for module in MODULES]
            done = subprocess.run(command, cwd=work, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
                done.check_returncode()
            runtime = _collect(Path(work), directory)
        stamp = {"python": sys.implementation.cache_tag, "runtime": runtime, "sources": digests}
        written = directory / f"{STAMP_NAME}.new"
        written.write_text(json.dumps(stamp, indent=2) + "\n")
        os.replace(written, directory / STAMP_NAME)
    finally:
        lock.release()


def _copy_sources(root: Path, work: Path) -> dict[str, str]:
    """Copies each module and the packages that name it into `work`; each source's SHA-256 as
    copied (what is compiled, even if the file changes meanwhile)."""
    import shutil

    package = root / "gengate"
    digests = {}
    for module in MODULES:
        source = source_of(module, root)
        for package_file in [p / "__init__.py" for p in source.parents if p.is_relative_to(package)]:
            copy = work / package_file.relative_to(root)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(package_file, copy)
        data = source.read_bytes()
        (work / source.relative_to(root)).write_bytes(data)
        digests[module] = _digest(data)
    return digests


def _collect(work: Path, directory: Path) -> str:
    """Moves what mypyc built in `work` into `directory`, each module's extension under its
    dotted name; the name of the runtime library they share."""
    import shutil

    for old in directory.glob("*.so"):
        old.unlink()  # a running process keeps its mapping of the old file
    runtime = None
    for module in MODULES:
        extension = _extension(work / Path(*module.split(".")).parent, module.rsplit(".", 1)[1])
        if extension is None:
            raise RuntimeError(f"mypyc built no extension for {module}")
        suffix = extension.name.split(".", 1)[1]
        shutil.copy2(extension, directory / f"{module}.{suffix}")
    for shared in work.glob("*__mypyc.*"):
        runtime = shared.name.split(".", 1)[0]
        shutil.copy2(shared, directory / shared.name)
    if runtime is None:
        raise RuntimeError("mypyc built no shared runtime library (a change in mypyc's layout?)")
    return runtime


def main() -> int:
    """`gengate compile`: 0 when compiled, 1 (saying why) when not."""
    import subprocess

    try:
        build()
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"gengate compile: not compiled ({exc}); the server runs as plain Python", file=sys.stderr)
        return 1
    print(f"gengate compile: compiled {', '.join(MODULES)}")
    return 0
