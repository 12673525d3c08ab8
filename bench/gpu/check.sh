#!/usr/bin/env bash
# GPU check, run from the repository root on a machine with an NVIDIA GPU; built for the device
# tool's nvidia-h200 machine (Python 3.12 with torch and transformers, no network): see
# bench/gpu/README.md for the exact `run` call.
#
#   bash bench/gpu/check.sh             # the whole check; logs and a summary under $OUT
#   bash bench/gpu/check.sh --dry-run   # preflight only (wheels, imports); no GPU needed
#   bash bench/gpu/check.sh --cpu       # every stage with the engine on CPU and an injected
#                                       # one-GPU list: tests this script, proves nothing on GPU
#
# Stages:
#  1. preflight: installs the carried wheels (.whl/, from bench/gpu/fetch_wheels.sh) into $SITE
#     with --no-index --no-deps, runs gengate from the source tree (PYTHONPATH=server:
#     clients/python:$SITE, no pip install of gengate) and imports everything the check needs;
#  2. NVML placement + the transformers engine on CUDA through a real worker process
#     (check_transformers.py): text, stream, each constraint kind, n=2 seeded, batching,
#     CPU-vs-GPU agreement, 16-concurrent vs sequential throughput ratio, lease release;
#  3. the in-process GPU pytest of the transformers engine (tests/engines/test_transformers.py -m gpu);
#  4. llama.cpp offload (check_llamacpp.py): the tiny GGUF in a worker placed on GPU 0 with n_gpu_layers
#     unset must put every layer on CUDA0; only with a llama-cpp-python built with GPU offload (in the
#     python, carried as a wheel in $LLAMACPP_WHEELS, or built here from the sdist $LLAMACPP_SDIST);
#     otherwise SKIPPED, saying why. --cpu runs it on the CPU build with an injected GPU;
#  5. vLLM (tests/vllm with GENGATE_VLLM_DEVICE=gpu, or cpu with --cpu and VLLM_PYTHON, + throughput.py
#     vs vLLM's own server), only where python
#     imports vllm or $VLLM_WHEELS holds a vllm wheel; otherwise SKIPPED, saying why.
# Exits non-zero only when a stage that ran failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit
MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --cpu) MODE=cpu ;;
  "") ;;
  *) echo "usage: bash bench/gpu/check.sh [--dry-run|--cpu]" >&2; exit 64 ;;
esac
OUT="${OUT:-/tmp/gengate-gpu-out}"
SITE="${SITE:-/tmp/site}"
PYTHON="${PYTHON:-python3}"
WORK="${WORK:-/tmp/gengate-gpu}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 GENGATE_CACHE="$WORK/cache"
[[ $MODE == gpu ]] || export GENGATE_PLACEMENT_FILE="${GENGATE_PLACEMENT_FILE:-$WORK/placement.json}"
SRC_PATH="$PWD/server:$PWD/clients/python"
# At most 8 files come back from $OUT (the device tool's limit): preflight.log transformers.log
# transformers.json pytest-transformers-gpu.log llamacpp.log llamacpp.json summary.txt there, where
# vLLM is skipped; vllm-tests.log vllm-throughput.log vllm-throughput.json where it runs (docker).
ROWS=()
FAILED=0
row() { # stage status detail
  ROWS+=("$(printf '%-34s %-8s %s' "$1" "$2" "$3")")
  [[ $2 == FAIL ]] && FAILED=1
  return 0
}
summary() {
  {
    echo
    printf '%-34s %-8s %s\n' "stage (mode: $MODE)" status detail
    printf '%s\n' "${ROWS[@]}"
    echo "logs: $OUT"
  } | tee "$OUT/summary.txt"
}

# --- 1. preflight ----------------------------------------------------------------------------
echo "== $(date -u +%FT%TZ) mode $MODE, python: $(command -v "$PYTHON") ($("$PYTHON" --version 2>&1))" \
  | tee "$OUT/preflight.log"
# WHEELS_DIR= (empty) skips the carried wheels: for a python that already has gengate's deps.
WHEELS_DIR="${WHEELS_DIR-.whl}"
if [[ -n $WHEELS_DIR ]] && compgen -G "$WHEELS_DIR/*.whl" >/dev/null; then
  wheels=("$WHEELS_DIR"/*.whl)
  echo "installing ${#wheels[@]} carried wheels from $WHEELS_DIR into $SITE" | tee -a "$OUT/preflight.log"
  if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}" >>"$OUT/preflight.log" 2>&1; then
    tail -5 "$OUT/preflight.log"
    row "preflight (wheels, imports)" FAIL "pip could not install $WHEELS_DIR, see preflight.log"
    summary
    exit 1
  fi
else
  echo "no carried wheels: using the python's own packages (see bench/gpu/fetch_wheels.sh)" \
    | tee -a "$OUT/preflight.log"
fi
export PYTHONPATH="$SRC_PATH:$SITE${PYTHONPATH:+:$PYTHONPATH}"

IMPORTS=(gengate.workers.main gengate.workers.factory gengate.engines.transformers gengate.engines.llamacpp
  gengate.models.tiny
  gengate.api.server gengate.telemetry gengate.cli gengate_client gengate_client.aio llguidance pydantic
  jsonschema lark gguf grpc grpc_health.v1.health grpc_reflection.v1alpha.reflection grpc_status.rpc_status
  google.rpc.status_pb2 opentelemetry.sdk.trace opentelemetry.instrumentation.grpc pynvml portalocker
  yaml numpy tokenizers safetensors pytest pytest_asyncio pytest_timeout torch transformers)
if "$PYTHON" - "$MODE" "${IMPORTS[@]}" <<'PY' 2>&1 | tee -a "$OUT/preflight.log"; then
import importlib, sys
mode, names = sys.argv[1], sys.argv[2:]
gpu_stack = {"torch", "transformers"}
failed, missing_gpu_stack = [], []
for name in names:
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        (missing_gpu_stack if name in gpu_stack and mode == "dry" else failed).append(f"{name}: {exc!r}")
        continue
    top = name.split(".")[0]
    if name == top:
        print(f"  {name:<16} {getattr(module, '__version__', '')}  {getattr(module, '__file__', '')}")
for line in missing_gpu_stack:
    print(f"  (dry run: not in this python, present on the GPU image) {line}")
for line in failed:
    print(f"IMPORT FAILED {line}")
if not failed:
    import gengate, gengate_client
    print(f"imports OK; gengate from {gengate.__file__}, client from {gengate_client.__file__}")
sys.exit(1 if failed else 0)
PY
  row "preflight (wheels, imports)" PASS "${#IMPORTS[@]} modules imported"
else
  row "preflight (wheels, imports)" FAIL "see preflight.log"
  summary
  exit 1
fi
if [[ $MODE == dry ]]; then
  "$PYTHON" bench/gpu/check_transformers.py --help >/dev/null && row "check_transformers.py loads" PASS "--help"
  "$PYTHON" bench/gpu/check_llamacpp.py --help >/dev/null && row "check_llamacpp.py loads" PASS "--help"
  summary
  exit "$FAILED"
fi

if [[ $MODE == gpu ]]; then
  if ! nvidia-smi -L 2>&1 | tee -a "$OUT/preflight.log"; then
    row "nvidia-smi" FAIL "no NVIDIA GPU or driver here"
    summary
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1 | tee -a "$OUT/preflight.log"
fi

# --- 2. NVML placement + transformers engine in a worker on CUDA ------------------------------
CPU_FLAG=()
[[ $MODE == cpu ]] && CPU_FLAG=(--cpu)
timeout 420 "$PYTHON" bench/gpu/check_transformers.py "${CPU_FLAG[@]}" --json "$OUT/transformers.json" \
  --model-dir "$WORK/tiny" 2>&1 | tee "$OUT/transformers.log"
rc=$?
counts="$("$PYTHON" -c "import json,collections,sys; r=json.load(open(sys.argv[1]))['results']; \
n=json.load(open(sys.argv[1]))['numbers']; c=collections.Counter(x['status'] for x in r); \
print(', '.join(f'{v} {k}' for k,v in sorted(c.items())) + (f\"; batch ratio {n['batch_ratio']:.2f}\" if 'batch_ratio' in n else ''))" \
  "$OUT/transformers.json" 2>/dev/null || echo "no results (exit $rc)")"
row "placement + transformers worker" "$([[ $rc -eq 0 ]] && echo PASS || echo FAIL)" "$counts"

# --- 3. in-process GPU pytest of the transformers engine -------------------------------------
timeout 300 "$PYTHON" -m pytest tests/engines/test_transformers.py -m gpu -o addopts="" -q \
  -p no:cacheprovider 2>&1 | tee "$OUT/pytest-transformers-gpu.log"
rc=$?
last="$(tail -1 "$OUT/pytest-transformers-gpu.log" | tr -d '=' | sed 's/^ *//')"
if [[ $rc -eq 0 ]] && grep -q "passed" <<<"$last"; then row "pytest -m gpu (transformers)" PASS "$last"
elif [[ $rc -eq 0 ]]; then row "pytest -m gpu (transformers)" SKIP "$last"
else row "pytest -m gpu (transformers)" FAIL "$last"; fi

# --- 4. llama.cpp offload in a worker placed on GPU 0 -----------------------------------------
LLAMA_LOG="$OUT/llamacpp.log"
offload_build() { # exit 0 when the python's llama-cpp-python can offload to a GPU
  "$PYTHON" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" \
    >/dev/null 2>&1
}
: >"$LLAMA_LOG"
if [[ $MODE == gpu ]] && ! offload_build; then
  if [[ -n ${LLAMACPP_WHEELS:-} ]] && compgen -G "$LLAMACPP_WHEELS/llama_cpp_python-*.whl" >/dev/null; then
    echo "installing llama-cpp-python from $LLAMACPP_WHEELS into $SITE" | tee -a "$LLAMA_LOG"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
      "$LLAMACPP_WHEELS"/*.whl >>"$LLAMA_LOG" 2>&1 || echo "pip could not install them" | tee -a "$LLAMA_LOG"
  elif [[ -n ${LLAMACPP_SDIST:-} && -f ${LLAMACPP_SDIST:-} ]]; then
    # nvcc and cmake are on the H200 image; scikit-build-core must be among the carried wheels.
    # One CUDA architecture (sm_90: H100/H200) keeps the build to minutes.
    echo "building $LLAMACPP_SDIST with CUDA (sm_${CUDA_ARCH:-90}) into $SITE" | tee -a "$LLAMA_LOG"
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DGGML_NATIVE=OFF" \
      CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" timeout 900 "$PYTHON" -m pip install -q --no-index --no-deps \
      --no-build-isolation --no-compile --target "$SITE" "$LLAMACPP_SDIST" >>"$LLAMA_LOG" 2>&1 \
      || echo "the CUDA build of $LLAMACPP_SDIST failed" | tee -a "$LLAMA_LOG"
  fi
fi
LLAMA_FLAG=()
if [[ $MODE == cpu ]] && "$PYTHON" -c "import llama_cpp" >/dev/null 2>&1; then
  LLAMA_FLAG=(--cpu)  # the CPU build with an injected GPU: tests the script, proves nothing on a GPU
elif [[ $MODE == cpu ]] || ! offload_build; then
  LLAMA_FLAG=(skip)
fi
if [[ ${LLAMA_FLAG[0]:-} == skip ]]; then
  msg="llama.cpp offload: SKIPPED — no llama-cpp-python built with GPU offload in this python (missing, or its CPU build); carry a CUDA wheel (LLAMACPP_WHEELS=dir) or the sdist (LLAMACPP_SDIST=file): see bench/gpu/README.md"
  echo "$msg" | tee -a "$LLAMA_LOG"
  row "llama.cpp offload (GPU 0)" SKIP "${msg#llama.cpp offload: SKIPPED — }"
else
  timeout 300 "$PYTHON" bench/gpu/check_llamacpp.py "${LLAMA_FLAG[@]}" --json "$OUT/llamacpp.json" \
    --model-dir "$WORK/tiny" 2>&1 | tee -a "$LLAMA_LOG"
  rc=$?
  counts="$("$PYTHON" -c "import json,collections,sys; r=json.load(open(sys.argv[1]))['results']; \
c=collections.Counter(x['status'] for x in r); print(', '.join(f'{v} {k}' for k,v in sorted(c.items())))" \
    "$OUT/llamacpp.json" 2>/dev/null || echo "no results (exit $rc)")"
  row "llama.cpp offload (GPU 0)" "$([[ $rc -eq 0 ]] && echo PASS || echo FAIL)" "$counts"
fi

# --- 5. vLLM ---------------------------------------------------------------------------------
WHEELS="${VLLM_WHEELS:-}"
VLLM_PY=""
if [[ -n ${VLLM_PYTHON:-} ]]; then  # a python that has vLLM, e.g. .venv-vllm/bin/python with --cpu
  VLLM_PY="$VLLM_PYTHON"
elif "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
  VLLM_PY="$PYTHON"
elif [[ -n $WHEELS ]] && compgen -G "$WHEELS/vllm-*.whl" >/dev/null; then
  "$PYTHON" -m venv "$WORK/vllm-venv" && VLLM_PY="$WORK/vllm-venv/bin/python"
  "$VLLM_PY" -m pip install -q --no-index --find-links "$WHEELS" -r bench/gpu/requirements-vllm.txt \
    -r bench/gpu/requirements-server.txt -r bench/gpu/requirements-check.txt 2>&1 | tee "$OUT/vllm-tests.log" \
    || { row "vLLM install" FAIL "from $WHEELS, see vllm-tests.log"; VLLM_PY=""; }
fi
VLLM_DEVICE=gpu SHAPE=small LOAD=(512 64 128)
[[ $MODE == cpu ]] && VLLM_DEVICE=cpu SHAPE=tiny LOAD=(96 16 64)
if [[ $MODE == cpu && -z $VLLM_PY ]]; then
  row "vLLM" SKIP "--cpu mode without VLLM_PYTHON (e.g. .venv-vllm/bin/python from scripts/setup-vllm)"
elif [[ -z $VLLM_PY ]]; then
  msg="vLLM: SKIPPED — not installable through the device tool (no network, 64 MiB carry); run in bench/gpu/Dockerfile.vllm"
  echo "$msg"
  row "vLLM tests + throughput" SKIP "${msg#vLLM: SKIPPED — }"
else
  # vLLM brings its own pins: gengate runs from source on top of them, without the carried wheels
  # unless the vLLM python lacks one of gengate's dependencies.
  VLLM_PATH="$SRC_PATH"
  PYTHONPATH="$VLLM_PATH" "$VLLM_PY" -c "import gengate.engines.vllm, gengate.workers.main, gengate_client.aio" \
    2>/dev/null || VLLM_PATH="$SRC_PATH:$SITE"
  MODEL="$(PYTHONPATH="$VLLM_PATH" "$VLLM_PY" bench/gpu/make_model.py "$WORK/$SHAPE-llama" --shape "$SHAPE")"
  # The same suite scripts/test --vllm runs on vLLM's CPU build, here with a GPU placed.
  PYTHONPATH="$VLLM_PATH" GENGATE_VLLM_MODEL="$MODEL" GENGATE_VLLM_DEVICE=$VLLM_DEVICE GENGATE_REQUIRE_VLLM=1 \
    timeout 900 "$VLLM_PY" -m pytest -m vllm tests/vllm -q -p no:cacheprovider 2>&1 | tee -a "$OUT/vllm-tests.log"
  rc=$?
  row "vLLM tests" "$([[ $rc -eq 0 ]] && echo PASS || echo FAIL)" "$(tail -1 "$OUT/vllm-tests.log" | tr -d '=')"
  PYTHONPATH="$VLLM_PATH" timeout 1200 "$VLLM_PY" bench/gpu/throughput.py --model "$MODEL" --device "$VLLM_DEVICE" \
    --requests "${REQUESTS:-${LOAD[0]}}" --concurrency "${CONCURRENCY:-${LOAD[1]}}" \
    --max-tokens "${MAX_TOKENS:-${LOAD[2]}}" \
    --json "$OUT/vllm-throughput.json" 2>&1 | tee "$OUT/vllm-throughput.log"
  rc=$?
  ratio="$(grep '^ratio' "$OUT/vllm-throughput.log" || echo "no ratio (exit $rc)")"
  if [[ $MODE == cpu ]]; then  # vLLM's CPU build: a number to read, not the GPU target
    row "vLLM throughput vs its server" "$([[ $rc -eq 0 ]] && echo INFO || echo FAIL)" "$ratio"
  else
    row "vLLM throughput vs its server" "$([[ $rc -eq 0 && $ratio == *PASS* ]] && echo PASS || echo FAIL)" "$ratio"
  fi
fi

summary
exit "$FAILED"
