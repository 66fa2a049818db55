"""The compile cache: graphs compiled once per model and configuration, found by later starts, never
found by another configuration, and filled safely by workers starting at once.

Starts are separate processes (a process remembers its own graphs), each building an engine with
``compile=True`` into one cache root and printing its greedy tokens and inductor's graph counts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvmesh.engine.compile_cache import compile_cache, compile_key, key_folder

from .conftest import PROMPTS
from .hf_reference import hf_greedy

pytestmark = pytest.mark.processes

N_NEW = 24

_START = """
import json, sys
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.compile_cache import compiled_graph_counts
from kvmesh.sampling import SamplingParams

path, rank, prompts, n = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
engine = LLMEngine(path, EngineConfig(num_blocks=64, compile=True, max_lora_rank=rank))
out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
print(json.dumps({"tokens": [o.token_ids for o in out], "graphs": compiled_graph_counts()}))
"""


def _start(model: Path, root: Path, rank: int = 16) -> subprocess.Popen:
    env = {**os.environ, "KVMESH_COMPILE_CACHE": str(root)}
    argv = [sys.executable, "-c", _START, str(model), str(rank), json.dumps(PROMPTS), str(N_NEW)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def model(checkpoints) -> Path:
    return checkpoints["llama-gqa"]


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    return [hf_greedy(model, p, N_NEW)[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def filled(model, tmp_path_factory) -> tuple[Path, dict]:
    """A cache root one cold start filled, and that start's result: a cold compile costs half a minute
    here, so the tests that need a filled root share this one (each reads it, or a copy it may change)."""
    root = tmp_path_factory.mktemp("filled-cache")
    return root, _result(_start(model, root))


@pytest.mark.native_cpu
def test_a_second_start_loads_the_graphs_the_first_compiled(model, expected, filled) -> None:
    root, cold = filled
    warm = _result(_start(model, root))

    assert cold["tokens"] == expected and warm["tokens"] == expected
    assert cold["graphs"]["compiled"] >= 2 and cold["graphs"]["cached"] == 0
    # Every graph torch can store came from the cache; the frozen batched one (oneDNN-packed
    # weights) is compiled again at every start.
    assert warm["graphs"]["compiled"] == 0
    assert warm["graphs"]["cached"] == cold["graphs"]["compiled"]
    assert warm["graphs"]["uncacheable"] == cold["graphs"]["uncacheable"] <= 1
    assert len(_folders(root)) == 1
    key = json.loads((_folders(root)[0] / "key.json").read_text())
    assert key["max_lora_rank"] == 16 and key["kv_pool"][2] == 64 and "torch" in key and "kernels" in key


@pytest.mark.native_cpu
def test_another_configuration_never_uses_those_graphs(model, expected, filled, tmp_path) -> None:
    root = shutil.copytree(filled[0], tmp_path / "cache")  # holds the first configuration's graphs
    assert len(_folders(root)) == 1
    other = _result(_start(model, root, rank=8))  # a flag in the key: its own folder, compiled anew

    assert other["tokens"] == expected
    assert other["graphs"]["cached"] == 0 and other["graphs"]["compiled"] >= 2
    assert len(_folders(root)) == 2


@pytest.mark.native_cpu
def test_workers_starting_at_once_compile_once_and_serve_the_same_tokens(model, expected, tmp_path) -> None:
    first, second = _start(model, tmp_path), _start(model, tmp_path)
    results = [_result(first), _result(second)]

    assert all(r["tokens"] == expected for r in results)
    # One compiled while the other waited on the folder's lock, then found every graph it could.
    compiled = sorted(r["graphs"]["compiled"] for r in results)
    assert compiled[0] == 0 and compiled[1] >= 2
    assert len(_folders(tmp_path)) == 1


def test_the_key_names_the_toolchain_and_a_changed_setting_moves_the_folder(tmp_path) -> None:
    key = compile_key({"model": "abc", "kv_pool": [30, 2, 64, 16, 3, 64]})
    assert {"python", "torch", "triton", "kernels"} <= set(key)
    assert key_folder(tmp_path, key) == key_folder(tmp_path, dict(key))
    assert key_folder(tmp_path, key) != key_folder(tmp_path, {**key, "model": "abd"})
    assert key_folder(tmp_path, key) != key_folder(tmp_path, {**key, "torch": "0.0"})


def test_a_compile_into_a_folder_waits_for_the_one_in_progress(tmp_path) -> None:
    key = {"model": "m"}
    events: list[str] = []
    inside = threading.Event()

    def first() -> None:
        with compile_cache(key, tmp_path):
            inside.set()
            time.sleep(0.5)
            events.append("first done")

    t = threading.Thread(target=first)
    t.start()
    inside.wait(10)
    with compile_cache(key, tmp_path) as folder:
        events.append("second in")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    t.join()
    assert events == ["first done", "second in"]
