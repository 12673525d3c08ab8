#!/usr/bin/env bash
# GPU check of the vLLM engine, run on a machine with an NVIDIA GPU, from the repository root:
#
#   bash bench/gpu/check.sh            # results also under $OUT (default /tmp/gengate-gpu-out)
#
# 1. installs vLLM and gengate's server dependencies into a fresh venv, offline, from the wheels
#    in $VLLM_WHEELS (default bench/gpu/wheels; see bench/gpu/README.md for the download), unless
#    the python given as $PYTHON already imports vllm;
# 2. builds a small random Llama (no download) and runs the GPU tests (pytest -m gpu): text,
#    stream, each constraint kind, n=2, cancel, concurrent batching;
# 3. compares throughput gengate -> vLLM with vLLM's own OpenAI server (target ratio >= 0.95)
#    and prints a table.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/gengate-gpu-out}"
mkdir -p "$OUT"
WHEELS="${VLLM_WHEELS:-bench/gpu/wheels}"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export GENGATE_PLACEMENT_FILE="${GENGATE_PLACEMENT_FILE:-$OUT/placement.json}"

nvidia-smi -L || { echo "check.sh: no NVIDIA GPU here" >&2; exit 2; }

if ! "$PYTHON" -c "import vllm" 2>/dev/null; then
  if ! ls "$WHEELS"/vllm-*.whl >/dev/null 2>&1; then
    echo "check.sh: vLLM is not installed and $WHEELS holds no vllm wheel (see bench/gpu/README.md)" >&2
    exit 3
  fi
  "$PYTHON" -m venv /tmp/gengate-vllm-venv
  PYTHON=/tmp/gengate-vllm-venv/bin/python
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" \
    -r bench/gpu/requirements-vllm.txt -r bench/gpu/requirements-server.txt -r bench/gpu/requirements-check.txt
fi
"$PYTHON" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"

# gengate itself runs from the source tree (the worker processes inherit this path).
export PYTHONPATH="$PWD/server:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}"
MODEL="$("$PYTHON" bench/gpu/make_model.py /tmp/gengate-small-llama)"
export GENGATE_VLLM_MODEL="$MODEL"
echo "model: $MODEL"

status=0
"$PYTHON" -m pytest -m gpu bench/gpu/test_vllm_gpu.py -q -p no:cacheprovider -o addopts="" \
  2>&1 | tee "$OUT/gpu-tests.log" || status=$?

"$PYTHON" bench/gpu/throughput.py --model "$MODEL" --requests "${REQUESTS:-512}" \
  --concurrency "${CONCURRENCY:-64}" --max-tokens "${MAX_TOKENS:-128}" --json "$OUT/throughput.json" \
  2>&1 | tee "$OUT/throughput.log" || status=$?

echo "check.sh: done (status $status); logs in $OUT"
exit "$status"
