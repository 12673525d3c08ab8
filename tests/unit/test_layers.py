"""The server's layering, read from its source: no import cycle (counting imports inside functions
and under TYPE_CHECKING, which hide cycles rather than remove them), and no import running back
up the layers (an engine importing the service, the service importing the gRPC layer)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "server" / "gengate"

# A module under the first prefix never imports one under the second.
UPWARDS = [
    (prefix, above)
    for prefixes, aboves in [
        (
            ("gengate.domain", "gengate.errors", "gengate.limits", "gengate.redaction", "gengate.lru",
             "gengate.observation", "gengate.caller"),
            ("gengate.backend", "gengate.router", "gengate.service", "gengate.api", "gengate.engines",
             "gengate.providers", "gengate.composites", "gengate.workers", "gengate.cli", "gengate.metrics"),
        ),
        (
            ("gengate.engines", "gengate.providers", "gengate.constraints"),
            ("gengate.router", "gengate.service", "gengate.api", "gengate.composites", "gengate.cli",
             "gengate.metrics"),
        ),
        (
            ("gengate.router", "gengate.service", "gengate.composites", "gengate.workers", "gengate.jobs"),
            ("gengate.api", "gengate.cli", "gengate.metrics"),
        ),
        (("gengate.metrics",), ("gengate.api", "gengate.cli")),
    ]
    for prefix in prefixes
    for above in aboves
]  # fmt: skip


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(module: str) -> set[str]:
    """The gengate modules `module` imports anywhere in its body, resolved to files that exist."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(kept + ([base] if base else []))
            # `from pkg import sub` imports pkg.sub when that is a module, else a name from pkg
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in GRAPH:
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_scan_sees_imports() -> None:
    assert "gengate.router" in GRAPH["gengate.service"]
    assert "gengate.engines.batching.engine" in GRAPH["gengate.engines.transformers.backend"]


def test_no_import_cycle() -> None:
    assert _cycles() == []


@pytest.mark.parametrize(("lower", "upper"), UPWARDS, ids=lambda p: p)
def test_no_import_runs_up_the_layers(lower: str, upper: str) -> None:
    offenders = sorted(
        f"{module} -> {imported}"
        for module, imports in GRAPH.items()
        if module == lower or module.startswith(lower + ".")
        for imported in imports
        if imported == upper or imported.startswith(upper + ".")
    )
    assert offenders == []


def test_the_server_imports_no_private_client_module() -> None:
    """The generated stubs are gengate_proto, which both sides import. Only the CLI modules,
    themselves clients, use the SDK (gengate_client), and never its private modules."""
    offenders = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] != "gengate_client":
                    continue
                is_cli = module == "gengate.cli" or module.startswith("gengate.cli_")
                if not is_cli or any(part.startswith("_") for part in parts):
                    offenders.append(f"{module} -> {name}")
    assert offenders == []


def test_only_the_metrics_package_imports_prometheus_client() -> None:
    """Domain code sees the observer interfaces of gengate.observation, never prometheus_client."""
    offenders = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(n.split(".")[0] == "prometheus_client" for n in names) and not (
                module == "gengate.metrics" or module.startswith("gengate.metrics.")
            ):
                offenders.append(module)
    assert offenders == []
    assert "gengate.metrics.families" in MODULES


def test_test_files_have_unique_names() -> None:
    # The test folders are no packages: pytest imports each test file by its basename, so two
    # files of one name in two folders stop the whole run at collection.
    tests = Path(__file__).resolve().parents[1]
    names: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        if "node_modules" not in path.parts:
            names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert not {name: where for name, where in names.items() if len(where) > 1}
