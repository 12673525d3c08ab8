"""bench/run: the peer comparisons in one sitting, written to bench/results/<UTC timestamp>/.

Sections (each measures gengate and its peer in turns, A B A B ...; see bench/sections.py):
  gateway      gengate vs LiteLLM's proxy vs the openai SDK direct, on one fake OpenAI upstream
  gguf         gengate serve vs llama-cpp-python's server on the tiny GGUF, plain and JSON Schema
  constraints  constrained ÷ unconstrained tok/s on llama.cpp, tiny and BENCH_32K
  compile      JSON Schema compile cold / cached / annotation-only change (ConstraintCompiler)

Writes results.json, results.md (ratios first) and one PNG per section (made by whichever python
has matplotlib: .venv-bench from bench/setup-peers, else this one), with the machine noted.

    bench/run [--quick] [--only gateway,gguf,constraints,compile] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from common import REPO
from peers import SKIPPED_NO_VENV, bench_python, bench_venv
from report import markdown
from sections import SECTIONS, Sizes

PACKAGES = ("grpcio", "openai", "llama_cpp_python", "llguidance", "jsonschema")


def log(message: str) -> None:
    print(f"[bench/run {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, load, python, package versions, commit."""
    cpu = "unknown"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["litellm (bench venv)"] = _bench_venv_version("litellm")
    versions["matplotlib (bench venv)"] = _bench_venv_version("matplotlib")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gengate": (REPO / "VERSION").read_text().strip(),
        "commit": commit,
        "packages": versions,
    }


def _bench_venv_version(name: str) -> str | None:
    venv = bench_venv()
    if venv is None:
        return None
    sites = list(venv.glob("lib/python*/site-packages"))
    for dist in importlib.metadata.distributions(path=[str(s) for s in sites]):
        if dist.metadata["Name"].lower() == name:
            return dist.version
    return None


def plot(out: Path) -> str:
    """Runs bench/plots.py with a python that has matplotlib; says what it made or why not."""
    candidates = [p for p in (bench_python(), Path(sys.executable)) if p is not None]
    for python in candidates:
        has = subprocess.run([str(python), "-c", "import matplotlib"], capture_output=True, check=False)
        if has.returncode == 0:
            done = subprocess.run(
                [str(python), str(REPO / "bench" / "plots.py"), str(out)],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                return f"failed: {done.stderr.strip()[-500:]}"
            return f"made by {python}"
    return SKIPPED_NO_VENV + " (no python with matplotlib)"


async def run(args: argparse.Namespace) -> Path:
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(SECTIONS)
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    started = datetime.datetime.now(datetime.UTC)
    out = Path(args.out) if args.out else REPO / "bench" / "results" / started.strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    sizes = Sizes.of(args.quick)
    results: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "rounds": sizes.rounds,
        "machine": machine(),
        "sections": {},
    }
    for name in names:
        log(f"{name}: running")
        began = time.perf_counter()
        try:
            section = await SECTIONS[name](sizes)
        except Exception as exc:  # one section failing still leaves the others' numbers
            traceback.print_exc()
            section = {"status": f"failed: {type(exc).__name__}: {exc}"[:500], "rows": [], "ratios": {}}
        section["seconds"] = round(time.perf_counter() - began, 1)
        results["sections"][name] = section
        log(f"{name}: {section['status']} in {section['seconds']} s")
    results["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    results["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    (out / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    results["plots"] = plot(out)
    (out / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    (out / "results.md").write_text(markdown(results))
    log(f"wrote {out} (plots: {results['plots']})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a smoke run (one small round each)")
    parser.add_argument("--only", default="", help=f"comma-separated sections: {','.join(SECTIONS)}")
    parser.add_argument("--out", default="", help="results folder (default bench/results/<UTC time>)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # servers inherit it; spinning pools turn noise into stalls
    out = asyncio.run(run(args))
    print(out)
    results = json.loads((out / "results.json").read_text())
    failed = [n for n, s in results["sections"].items() if str(s["status"]).startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
