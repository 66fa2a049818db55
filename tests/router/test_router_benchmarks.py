"""The router benchmarks end to end on tiny inputs (figures checked for shape, never speed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def synthetic_trace(path: Path) -> Path:
    """Three conversations of growing turns plus one-off requests, a second apart."""
    lines = []
    next_id = 100
    for turn in range(6):
        for conv in range(3):
            ids = [0] + [conv * 10 + k + 1 for k in range(turn + 1)]
            lines.append(
                {
                    "timestamp": 1000 * len(lines),
                    "input_length": 512 * len(ids) - 100,
                    "output_length": 20,
                    "hash_ids": ids,
                }
            )
        lines.append(
            {
                "timestamp": 1000 * len(lines),
                "input_length": 900,
                "output_length": 5,
                "hash_ids": [next_id, next_id + 1],
            }
        )
        next_id += 2
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


POLICY_KEYS = {"hit_rate", "gpu_hit_rate", "max_mean_load", "ttft_mean_s", "ttft_p90_s"}


def replay(tmp_path: Path, name: str, *args: str) -> tuple[str, dict]:
    trace = synthetic_trace(tmp_path / "trace.jsonl")
    out_json = tmp_path / f"{name}.json"
    stdout = run("router_trace.py", "--trace", str(trace), "--workers", "3", "--json", str(out_json), *args)
    return stdout, json.loads(out_json.read_text())


def check_policies(result: dict, ideal: float) -> None:
    for name in ("router", "round_robin", "least_loaded"):
        r = result[name]
        assert set(r) == POLICY_KEYS
        assert 0 <= r["gpu_hit_rate"] <= r["hit_rate"] <= ideal and r["max_mean_load"] >= 1
        assert r["ttft_mean_s"] > 0 and r["ttft_p90_s"] > 0


def test_trace_replay_on_a_synthetic_trace(tmp_path):
    stdout, result = replay(tmp_path, "gpu", "--capacity-tokens", "20000")
    assert "round_robin" in stdout and "ideal hit rate" in stdout
    assert {"router", "round_robin", "least_loaded", "ideal_hit_rate", "gpu_only"} <= set(result)
    check_policies(result, result["ideal_hit_rate"])
    check_policies(result["gpu_only"], result["ideal_hit_rate"])
    # Later turns reuse earlier ones: an infinite cache hits, the router does too.
    assert result["ideal_hit_rate"] > 0.5
    assert result["gpu_only"]["router"]["hit_rate"] > 0.3


def test_kvstore_tier_is_shared_by_every_policy_and_zero_turns_it_off(tmp_path):
    # GPU caches too small for a conversation (10 blocks each): only the kvstore keeps them.
    _, with_store = replay(tmp_path, "both", "--capacity-tokens", "5120")
    _, gpu_only = replay(tmp_path, "off", "--capacity-tokens", "5120", "--kvstore-capacity-tokens", "0")
    assert "gpu_only" not in gpu_only
    for name in ("router", "round_robin", "least_loaded"):
        assert with_store["gpu_only"][name] == gpu_only[name]
        assert gpu_only[name]["hit_rate"] == gpu_only[name]["gpu_hit_rate"]
        # Round robin spreads each conversation over every worker; the kvstore still serves it.
        assert with_store[name]["hit_rate"] > gpu_only[name]["hit_rate"]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not on PATH")
def test_latency_benchmark_smoke(tmp_path):
    out_json = tmp_path / "lat.json"
    stdout = run(
        "router_latency.py",
        "--blocks",
        "40",
        "400",
        "--iters",
        "3",
        "--background-blocks",
        "10",
        "--json",
        str(out_json),
    )
    assert "decision p50 ms" in stdout
    result = json.loads(out_json.read_text())
    assert set(result) == {"40", "400"}
    assert result["400"]["chosen"] == "w0" and result["400"]["matched_blocks"]["w0"] == 400
