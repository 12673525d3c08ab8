#!/usr/bin/env bash
# Downloads, on a machine WITH PyPI access, the wheels that the device tool's GPU machine
# (nvidia-h200: Python 3.12, x86-64, no network) needs to run gengate from the source tree:
# gengate's runtime dependencies (server + Python client, plus pytest-asyncio for the GPU
# pytest) resolved for CPython 3.12 manylinux, minus what that image already has
# (bench/gpu/device-preinstalled.txt), plus a few small version-sensitive packages carried
# anyway (ALWAYS_CARRY). They land in .whl/ at the repository root (git-ignored), which a
# `run` call carries (carry: [".whl"]) and bench/gpu/check.sh installs with --no-index --no-deps.
#
#   bash bench/gpu/fetch_wheels.sh        # PIP_PYTHON=... to pick the python whose pip is used
#
# vLLM is deliberately not fetched: with its own torch it is several GB, far over the 64 MiB a
# call carries (see bench/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.." || exit
DEST="${DEST:-.whl}"
LIMIT_MIB="${LIMIT_MIB:-48}" # leave room under the tool's 64 MiB for the working tree itself
if [[ -z "${PIP_PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PIP_PYTHON=.venv/bin/python; else PIP_PYTHON=python3; fi
fi
# Carried even though the image has them: the generated gRPC/protobuf code checks the runtime
# version at import, pydantic needs a recent typing-extensions, and OpenTelemetry bounds wrapt.
ALWAYS_CARRY="grpcio protobuf typing-extensions wrapt"
PLATFORMS=(--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64)
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  "${PLATFORMS[@]}")

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# 1. gengate's declared runtime dependencies, read from the two pyproject files.
"$PIP_PYTHON" - "$work/requirements.txt" <<'PY'
import sys, tomllib
reqs = []
for path in ("pyproject.toml", "clients/python/pyproject.toml"):
    with open(path, "rb") as f:
        reqs += tomllib.load(f)["project"]["dependencies"]
reqs = [r for r in reqs if not r.startswith("gengate")]  # the local packages run from source
reqs.append("pytest-asyncio>=1.0")  # tests/engines/test_transformers.py -m gpu on the machine
open(sys.argv[1], "w").write("\n".join(sorted(set(reqs))) + "\n")
PY

# 2. Their whole closure as pip resolves it for CPython 3.12 manylinux (nothing installed).
"$PIP_PYTHON" -m pip install -q --dry-run --ignore-installed --target "$work/none" \
  --report "$work/report.json" "${TARGET[@]}" -r "$work/requirements.txt"

# 3. Minus what the GPU image already has (unless version-sensitive), pinned to the resolved versions.
"$PIP_PYTHON" - "$work/report.json" bench/gpu/device-preinstalled.txt "$ALWAYS_CARRY" \
  "$work/carry.txt" <<'PY'
import json, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
report = json.load(open(sys.argv[1]))
present = {norm(l.strip()) for l in open(sys.argv[2]) if l.strip() and not l.startswith("#")}
always = {norm(n) for n in sys.argv[3].split()}
resolved = {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
carry = sorted(n for n in resolved if n not in present or n in always)
skipped = sorted(n for n in resolved if n not in carry)
print("resolved:", len(resolved), "| already on the GPU image:", " ".join(skipped))
open(sys.argv[4], "w").write("".join(f"{n}=={resolved[n]}\n" for n in carry))
PY

# 4. Exactly those wheels, no dependencies (step 2 resolved them).
rm -rf "$DEST"
mkdir -p "$DEST"
"$PIP_PYTHON" -m pip download -q --no-deps "${TARGET[@]}" -d "$DEST" -r "$work/carry.txt"
echo "carried ($(wc -l <"$work/carry.txt") wheels): $(sed 's/==/ /' "$work/carry.txt" | paste -sd, | sed 's/,/, /g')"

# 5. One version of each (two stop the install there) and the size against the tool's limit.
dupes="$(find "$DEST" -name '*.whl' -printf '%f\n' | cut -d- -f1 | tr '[:upper:]' '[:lower:]' | sort | uniq -d)"
[[ -z "$dupes" ]] || { echo "fetch_wheels.sh: two versions of: $dupes" >&2; exit 1; }
wheels_kib="$(du -sk "$DEST" | cut -f1)"
tree_kib="$( { git ls-files -z; git ls-files -z --others --exclude-standard; } \
  | xargs -0 -r du -ck 2>/dev/null | tail -1 | cut -f1)"
echo "size: wheels $((wheels_kib / 1024)) MiB + working tree $((tree_kib / 1024)) MiB" \
  "= $(((wheels_kib + tree_kib) / 1024)) MiB of the 64 MiB a run call carries"
if ((wheels_kib > LIMIT_MIB * 1024)); then
  echo "fetch_wheels.sh: $DEST is over ${LIMIT_MIB} MiB" >&2
  exit 1
fi
