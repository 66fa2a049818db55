"""What of bench/kernels_gpu.py runs without a GPU: its CLI, its refusal without CUDA, and
the byte/FLOP counts and input builders its numbers rest on."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernels_gpu.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kernels_gpu", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels_gpu"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_help() -> None:
    run = _run("--help")
    assert run.returncode == 0
    assert "--no-sweep" in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_exits_with_a_clear_message_without_cuda() -> None:
    run = _run()
    assert run.returncode == 2
    assert "no CUDA device here" in run.stderr


def test_decode_bytes_counts_each_kv_row_once(script: ModuleType) -> None:
    kv = 2 * 64 * 4096 * 8 * 128 * 2
    q_and_out = 2 * 64 * 32 * 128 * 2
    tables = 64 * (4096 // 16) * 4
    assert script.decode_bytes(64, 4096, 32, 8, 128) == kv + q_and_out + tables


def test_attention_flops(script: ModuleType) -> None:
    # A causal prefill of n tokens computes n(n+1)/2 (query, key) pairs, two matmuls of 2 FLOPs each.
    assert script.attention_flops(2, 0, 8, 4, 64) == 4 * 2 * 4 * 64 * 36
    # An extend sees the whole prefix from every new token.
    assert script.attention_flops(1, 10, 3, 1, 1) == 4 * (3 * 10 + 6)
    assert script.matmul_flops(2, 3, 4) == 48


def test_json_path(script: ModuleType) -> None:
    assert script.default_json_path({"OUT": "/tmp/out"}) == Path("/tmp/out/kernels_gpu.json")
    assert script.default_json_path({}).parts[-3:] == ("bench", "results", "kernels_gpu.json")


def test_paged_kv_shuffles_whole_blocks_and_marks_the_tails(script: ModuleType) -> None:
    lens = [1, 16, 40]
    kv = script.paged_kv(lens, 2, 8, torch.float32, "cpu")
    owned = [kv.block_tables[i, : -(-n // 16)].tolist() for i, n in enumerate(lens)]
    assert sorted(b for blocks in owned for b in blocks) == list(range(kv.k_cache.shape[0]))
    last_of_40 = owned[2][-1]
    assert (kv.k_cache[last_of_40, 40 - 32 :] == script.UNOWNED).all()
    assert (kv.k_cache[last_of_40, : 40 - 32].abs() < script.UNOWNED).all()
    assert script.query_start_loc([3, 1, 5], "cpu").tolist() == [0, 3, 4, 9]
