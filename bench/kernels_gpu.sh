#!/usr/bin/env bash
# Triton kernels on a CUDA GPU, in one run of under 8 minutes with nothing to install:
# bf16/fp8 correctness against the torch references, then timings against ceilings
# measured in the same run (see bench/kernels_gpu.py). The log and JSON land in $OUT
# when it is set (the device machine), else in bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # interpreted kernels would run on the CPU
export PYTHONUNBUFFERED=1
out_dir="${OUT:-bench/results}"
mkdir -p "$out_dir"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 || true
PYTHON="$(command -v python3 || command -v python)"
"$PYTHON" bench/kernels_gpu.py --json "$out_dir/kernels_gpu.json" "$@" 2>&1 | tee "$out_dir/kernels_gpu.log"
