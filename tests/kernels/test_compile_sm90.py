"""Every kernel compiles for Hopper (sm_90) through its wrapper's real launch configuration,
without a GPU: no register spills, shared memory within the per-block limit, and the
attention/matmul hot loops on tensor cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kernels.dispatch import OPS

REPO = Path(__file__).resolve().parents[2]
HOPPER_MAX_SHARED_BYTES = 227 * 1024


def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, don't interpret
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated to silence its warning
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_sm90"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    kernels = [json.loads(line) for line in run.stdout.splitlines()]

    assert {k["op"] for k in kernels} >= set(OPS)
    for k in kernels:
        assert k["stack"] == 0 and k["local"] == 0, f"{k['op']}/{k['kernel']} spills: {k}"
        assert k["shared_bytes"] <= HOPPER_MAX_SHARED_BYTES, k
    extend = next(k for k in kernels if k["op"] == "paged_extend_attention")
    assert extend["tensor_core_ops"] == ["wgmma.mma_async"]
    decode = next(k for k in kernels if k["op"] == "paged_decode_attention" and k["kernel"] == "_decode_split_kernel")
    assert decode["tensor_core_ops"], "decode attention's dots should use the tensor cores"
    prefill_mm = [k for k in kernels if k["op"] == "fp8_scaled_mm" and k["num_warps"] == 8]
    assert prefill_mm and prefill_mm[0]["tensor_core_ops"] == ["wgmma.mma_async"]
