#!/usr/bin/env bash
# The GPU path checked in one run (issue 41): the Triton kernels, the engine and the mesh on a bare CUDA
# machine with nothing to install, in under 8 minutes. Each part writes its log and JSON into
# the output folder and prints its tables last; the exit status is non-zero if any part failed.
#
#   bench/gpu_check.sh OUT_DIR              # on the GPU machine (OUT_DIR: $OUT there)
#   bench/gpu_check.sh OUT_DIR --dry-run    # the same parts on this CPU: interpreter, tiny shapes
#
# 1. bench/kernels_gpu.py: every Triton kernel against its torch reference, timed against the
#    copy bandwidth and bf16 matmul rate measured in the same run.
# 2. bench/gpu_engine.py: the engine's greedy output against transformers (float32) on
#    random-init SmolLM2-135M and ~1.2B Llama shapes, decode tokens/s at 1/16/64 sequences
#    against the roofline, eager and compiled.
# 3. bench/gpu_mesh.py: a prefill and a decode worker sharing the GPU, the KV hand-off over NIXL
#    (VRAM to VRAM) and over gRPC, 16 streams through the gateway; blocks, bytes and hand-off time
#    from the metrics; both transports must give the same text. Needs redis-server on the PATH.
# Packages the GPU machine lacks travel as wheels in .whl/ (see the device README: pip download
# --python-version 3.12 ...); they are installed into /tmp/site first when the folder is there.
# Not yet here: tensor parallelism (not built yet; one GPU could only show TP1 vs TP2 on one device).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/gpu_check.sh OUT_DIR [--dry-run]}"
shift
dry=()
if [ "${1:-}" = "--dry-run" ]; then dry=(--dry-run); fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PYTHON="$(command -v python3 || command -v python)"

if [ ${#dry[@]} -eq 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ ${#dry[@]} -eq 0 ]; then
  unset TRITON_INTERPRET  # interpreted kernels would run on the CPU
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
  kernel_args=(--budget-s 150)
else
  export TRITON_INTERPRET=1
  kernel_args=(--dry-run)
fi

status=0
"$PYTHON" bench/kernels_gpu.py --json "$out/kernels_gpu.json" "${kernel_args[@]}" 2>&1 | tee "$out/kernels_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PYTHON" bench/gpu_engine.py --json "$out/gpu_engine.json" "${dry[@]}" 2>&1 | tee "$out/gpu_engine.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PYTHON" bench/gpu_mesh.py --json "$out/gpu_mesh.json" "${dry[@]}" 2>&1 | tee "$out/gpu_mesh.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED); logs and JSON in $out"
exit $status
