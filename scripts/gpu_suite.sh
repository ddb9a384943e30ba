#!/usr/bin/env bash
# The GPU checks of the xformers backend, for a machine with a CUDA GPU.
#
#   scripts/gpu_suite.sh [LOG_DIR]          (or: make test-gpu)
#
# LOG_DIR defaults to $OUT when set (the device tool's output folder), else ./gpu-logs. It gets
# six files: env.txt (torch, CUDA, GPU, xformers, backend availability, operators found),
# pytest_gpu.log + pytest_gpu.xml (tests/backends/test_xformers_gpu.py and the generic
# op suite, which is parametrized over every backend), pytest_all.log (the whole suite, unless
# GPU_SUITE_ALL=0), bench.json + bench.err (benchmarks/xformers_attention.py, BENCH_ARGS,
# default --quick). Exit status: that of the GPU tests.
#
# The Python that runs it ($PYTHON, default python3) needs torch with CUDA and the xformers
# built for that torch. `pip install "attnexport[xformers]"` resolves the pairing:
#   torch 2.8.0   -> xformers 0.0.32.post2 (pins torch==2.8.0; bundles FlashAttention-3 for sm90;
#                    FlashAttention-2 is PyTorch's, without paged KV unless flash_attn is installed)
#   torch >= 2.10 -> xformers 0.0.35 (stable ABI, 3 MiB wheel; no bundled FlashAttention-3: the
#                    flash-attn-3 name on PyPI is a placeholder; its _C.so links libcudart.so.12,
#                    so on a CUDA 13 torch check env.txt: the library may not load)
#
# A GPU machine with torch 2.11.0+cu130 and no network gets xformers as wheels carried in
# .whl/. Here, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl xformers==0.0.35 nvidia-cuda-runtime-cu12==12.9.79
# then a device run with carry [".whl"] and the command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#   && export PYTHONPATH=/tmp/site \
#      LD_LIBRARY_PATH=/tmp/site/nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-} \
#   && bash scripts/gpu_suite.sh "$OUT"
# (xformers 0.0.32.post2 cannot travel there: it needs torch 2.8.0 and its CUDA 12 libraries,
# gigabytes against the 64 MiB a call may carry.)
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-gpu-logs}}
PY=${PYTHON:-python3}
mkdir -p "$LOG"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1

"$PY" - >"$LOG/env.txt" 2>&1 <<'EOF'
import importlib.metadata

import torch

print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("GPU", torch.cuda.get_device_name(), "sm%d%d" % torch.cuda.get_device_capability())
try:
    print("xformers", importlib.metadata.version("xformers"))
except importlib.metadata.PackageNotFoundError:
    print("xformers not installed")
try:
    import xformers

    print("xformers C++ library loaded:", xformers._has_cpp_library)
except Exception as error:
    print("import xformers failed:", repr(error))

import attnexport  # noqa: F401
from attnexport.custom_ops import get_backend

reason = get_backend("xformers").unavailable_reason()
print("xformers backend:", reason or "available")
if reason is None:
    from attnexport.backends.xformers import device_facts

    print(device_facts(torch.cuda.current_device()))
EOF
cat "$LOG/env.txt"

"$PY" -m pytest tests/backends/test_xformers_gpu.py tests/custom_ops/test_ops_vs_reference.py \
  -q -ra -p no:cacheprovider --junitxml="$LOG/pytest_gpu.xml" 2>&1 | tee "$LOG/pytest_gpu.log"
status=${PIPESTATUS[0]}

if [ "${GPU_SUITE_ALL:-1}" = 1 ]; then
  "$PY" -m pytest -q -ra -p no:cacheprovider >"$LOG/pytest_all.log" 2>&1
  tail -n 3 "$LOG/pytest_all.log"
fi

# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
"$PY" benchmarks/xformers_attention.py ${BENCH_ARGS:---quick} --json >"$LOG/bench.json" 2>"$LOG/bench.err"
echo "benchmark exit status $? (results in $LOG/bench.json)"
exit "$status"
