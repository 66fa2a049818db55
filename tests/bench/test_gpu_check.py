"""bench/gpu_check.sh --dry-run: the GPU run's every part on this CPU (Triton's interpreter, tiny
shapes), so the script a lent GPU runs cannot rot between runs. Its checks must pass here too:
the kernels against their references, the engine's greedy tokens against transformers', the
mesh's hand-offs on both transports."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(900), pytest.mark.processes]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    # As a user's shell runs it: without the suite's interpreter and compile switches.
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVMESH_COMPILE", "KVMESH_DECODE_COMPILE")
    }
    run = subprocess.run(
        ["bench/gpu_check.sh", str(out), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=880
    )
    return run, out


def test_the_dry_run_passes_and_writes_each_part(dry_run) -> None:
    run, out = dry_run
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "gpu_check: PASSED" in run.stdout
    for name in ("kernels_gpu.json", "kernels_gpu.log", "gpu_engine.json", "gpu_engine.log", "gpu_mesh.json"):
        assert (out / name).stat().st_size > 0, name


def test_every_kernel_is_checked_and_timed(dry_run) -> None:
    _, out = dry_run
    report = json.loads((out / "kernels_gpu.json").read_text())
    assert report["passed"] and not report["errors"]
    checked = " ".join(c["name"] for c in report["checks"])
    for kernel in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary", "write_kv_cache", "decode ",
                   "extend ", "fp8 quantize", "fp8_scaled_mm", "int8_scaled_mm", "lora_add", "bitwise",
                   "gelu_tanh_and_mul", "window=", "moe_experts", "mla_decode"):  # fmt: skip
        assert kernel in checked, kernel
    timed = {t["kernel"] for t in report["timings"]}
    assert {"paged_decode_attention", "mla_decode_attention", "fp8_scaled_mm", "rms_norm", "write_kv_cache"} <= timed
    assert report["ceilings"]["copy_GBps"] > 0 and report["ceilings"]["matmul_bf16_TFLOPs"] > 0


def test_the_engine_matches_transformers_and_is_measured_against_its_roofline(dry_run) -> None:
    _, out = dry_run
    report = json.loads((out / "gpu_engine.json").read_text())
    assert report["passed"] and not report["errors"]
    (check,) = report["checks"]
    assert check["identical"] == check["prompts"] > 0
    assert {s["batch"] for s in report["speeds"]} == {1, 4}
    assert all(0 < s["fraction_of_roofline"] and s["decode_tokens_per_s"] > 0 for s in report["speeds"])


def test_the_mesh_hands_every_request_off_on_both_transports_with_the_same_text(dry_run) -> None:
    _, out = dry_run
    report = json.loads((out / "gpu_mesh.json").read_text())
    assert report["passed"] and not report["errors"], report
    assert [r["transport"] for r in report["runs"]] == ["nixl", "grpc"]
    for run in report["runs"]:
        assert run["remote_prefills"] == run["streams"] == 4
        assert run["bytes_pulled"] > 0 and run["transfer_failures"] == 0 and run["kv_transfer_seconds"] > 0
