#!/usr/bin/env bash
# The GPU checks of the xformers backend and the ort-cuda target, for a machine with a CUDA GPU.
#
#   scripts/gpu_suite.sh [LOG_DIR]          (or: make test-gpu)
#
# LOG_DIR defaults to $OUT when set (the device tool's output folder), else ./gpu-logs. It gets:
#   env.txt         torch, CUDA, GPU, xformers, onnxruntime and its providers, backend
#                   availability, the xFormers operators found
#   pytest_gpu.log  + pytest_gpu.xml: tests/backends/test_xformers_gpu.py (kernels vs the float64
#                   reference and sdpa, operator routing, the engine end to end vs the CPU, the
#                   ort-cuda artifact on onnxruntime's CUDA EP) and the CUDA cases of the executor,
#                   target and cache-dtype suites
#   bench.json      + bench.err: benchmarks/xformers_attention.py (BENCH_ARGS, default --quick)
#   pytest_all.log  the whole suite (only with GPU_SUITE_ALL=1)
# Stages are bounded by GPU_TEST_TIMEOUT and GPU_BENCH_TIMEOUT (seconds), so a hung stage still
# leaves the others' logs. Exit status: that of the GPU tests.
#
# Python: $PYTHON (default python3) with torch built for CUDA. Wheels the machine lacks can be
# put in .whl/ (one version of each): they are installed with --no-deps into /tmp/site, first on
# PYTHONPATH. `pip install "attnexport[xformers]"` resolves xformers for the torch:
#   torch 2.8.0   -> xformers 0.0.32.post2 (pins torch==2.8.0; bundles FlashAttention-3 for sm90)
#   torch >= 2.10 -> xformers 0.0.35 (stable ABI, 3 MiB wheel; no bundled FlashAttention-3; its
#                    _C.so links libcudart.so.12: beside a CUDA 13 torch add the wheel
#                    nvidia-cuda-runtime-cu12, whose lib folder this script puts on the path)
# onnxruntime-gpu (1.31.1 is a CUDA 13 build: a 255 MB wheel, more than one device call carries)
# can be given in parts: $ORT_GPU_PARTS, a glob of files NAME.whl.partNN concatenated in name
# order into NAME.whl, checked against $ORT_GPU_SHA256 when set, installed into /tmp/site-ort
# ahead of the machine's onnxruntime; it finds cuDNN and cuBLAS in the nvidia-* packages beside
# torch (this script puts their lib folders on LD_LIBRARY_PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-gpu-logs}}
PY=${PYTHON:-python3}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

mapfile -t parts < <(compgen -G "${ORT_GPU_PARTS:-/nonexistent}" | sort)
if [ "${#parts[@]}" -gt 0 ]; then
  wheel=/tmp/$(basename "${parts[0]%.part*}")
  cat "${parts[@]}" >"$wheel"
  sum=$(sha256sum "$wheel" | cut -d' ' -f1)
  if [ -n "${ORT_GPU_SHA256:-}" ] && [ "$sum" != "$ORT_GPU_SHA256" ]; then
    echo "onnxruntime-gpu: $wheel has sha256 $sum, not $ORT_GPU_SHA256: not installed" \
      | tee "$LOG/ort-gpu.txt"
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target \
      /tmp/site-ort "$wheel" && export PYTHONPATH="/tmp/site-ort${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi

# CUDA libraries from the nvidia-* wheels (torch's, and any carried), for xformers' _C.so and
# onnxruntime's CUDA provider.
find_nvidia_libs='
import glob, os, sys
dirs = [d for base in sys.path for d in glob.glob(os.path.join(base, "nvidia", "*", "lib"))]
print(":".join(dict.fromkeys(d for d in dirs if os.path.isdir(d))))
'
nvidia_libs=$("$PY" -c "$find_nvidia_libs" 2>/dev/null)
export LD_LIBRARY_PATH="${nvidia_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

"$PY" scripts/gpu_env.py >"$LOG/env.txt" 2>&1
cat "$LOG/env.txt"

# shellcheck disable=SC2086  # GPU_PYTEST_ARGS is a list of arguments
timeout "${GPU_TEST_TIMEOUT:-900}" "$PY" -m pytest tests/backends/test_xformers_gpu.py \
  tests/runtime/test_executors.py tests/lowering/test_targets.py \
  tests/custom_ops/test_kv_cache_dtype.py -k "xformers or ort_cuda or cuda" \
  -q -ra -p no:cacheprovider ${GPU_PYTEST_ARGS:-} --junitxml="$LOG/pytest_gpu.xml" 2>&1 \
  | tee "$LOG/pytest_gpu.log" | tail -n 40
status=${PIPESTATUS[0]}

# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
timeout "${GPU_BENCH_TIMEOUT:-900}" "$PY" benchmarks/xformers_attention.py ${BENCH_ARGS:---quick} \
  --json >"$LOG/bench.json" 2>"$LOG/bench.err"
echo "benchmark exit status $? (results in $LOG/bench.json, progress in $LOG/bench.err)"

if [ "${GPU_SUITE_ALL:-0}" = 1 ]; then
  "$PY" -m pytest -q -ra -p no:cacheprovider >"$LOG/pytest_all.log" 2>&1
  tail -n 3 "$LOG/pytest_all.log"
fi
exit "$status"
