"""Starting a whole mesh as real processes for end-to-end tests, and reading its metrics."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from kvmesh.launcher.restart import RestartPolicy
from kvmesh.launcher.scrape import scrape
from kvmesh.launcher.spec import MeshOptions
from kvmesh.launcher.supervisor import Mesh
from kvmesh.launcher.topology import build_topology
from kvmesh.models.bpe import train_tokenizer, write_tokenizer
from kvmesh.runtime.otlp_receiver import OtlpReceiver
from kvmesh.runtime.ports import free_port
from tests.engine.conftest import VOCAB, write_checkpoint

BLOCK = 16

T = TypeVar("T")


def write_model(path: Path) -> Path:
    """A tiny Llama written by transformers, with a real tokenizer beside it."""
    write_checkpoint(path, "llama-gqa", eos_token_id=0)
    tok_dir = path.parent / "tok"
    tok_dir.mkdir(exist_ok=True)
    write_tokenizer(train_tokenizer(VOCAB, corpus_bytes=200_000), tok_dir)
    for f in tok_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def mesh_options(
    model: Path,
    decode_workers: int = 1,
    role_env: dict[str, dict[str, str]] | None = None,
    *,
    prefill_workers: int = 1,
) -> MeshOptions:
    """The end-to-end tests' mesh: ``role_env`` settings for every process of a role on top of its own."""
    env = {
        # Never prefill on decode, so the tests see the disaggregated path every time.
        "router": {"KVMESH_LOCAL_PREFILL_MAX_UNCACHED_TOKENS": "0", "KVMESH_LOCAL_PREFILL_MIN_HIT_FRACTION": "2"},
        "prefill": {"KVMESH_NUM_BLOCKS": "128"},
        "decode": {"KVMESH_NUM_BLOCKS": "128"},
        # A free port for the OpenAI HTTP API rather than its default 8000, so meshes can run side by side.
        "gateway": {"KVMESH_HTTP_PORT": str(free_port())},
    }
    for role, extra in (role_env or {}).items():
        env[role] = {**env.get(role, {}), **extra}
    return MeshOptions(
        model=model, prefill=prefill_workers, decode=decode_workers, gateway_port=0, grace_seconds=3.0, role_env=env
    )


def start_mesh(
    model: Path,
    run_dir: Path,
    decode_workers: int = 1,
    role_env: dict[str, dict[str, str]] | None = None,
    *,
    prefill_workers: int = 1,
    restart: RestartPolicy | None = None,
    process_env: dict[str, dict[str, str]] | None = None,
) -> Mesh:
    """``role_env``: settings for every process of a role; ``process_env``: for one process (e.g. "decode-0")."""
    options = mesh_options(model, decode_workers, role_env, prefill_workers=prefill_workers)
    topology = build_topology(options, run_dir)
    if process_env:
        processes = tuple(replace(p, env={**p.env, **process_env.get(p.name, {})}) for p in topology.processes)
        topology = replace(topology, processes=processes)
    return Mesh(topology, run_dir, restart=restart).start()


MESH_ROLES = ("router", "prefill", "decode", "kvstore", "speculator", "gateway")


def traced(receiver: OtlpReceiver, role_env: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """``role_env`` with every service exporting all its spans to ``receiver``, each batch within 0.1 s."""
    tracing = {"KVMESH_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    return {role: {**tracing, **role_env.get(role, {})} for role in {*MESH_ROLES, *role_env}}


def http_url(mesh: Mesh) -> str:
    """The base URL of the gateway's OpenAI-compatible HTTP API."""
    gateway = mesh.topology.get("gateway")
    return f"http://{gateway.host}:{gateway.env['KVMESH_HTTP_PORT']}"


def metrics(mesh: Mesh, process: str) -> dict[str, float]:
    """The process's /metrics as {name or name{labels}: value}."""
    return scrape(mesh.topology.get(process), timeout_s=5)


def held(mesh: Mesh, prefill: Sequence[str], decode: Sequence[str]) -> dict[str, float]:
    """What finished requests must have given back, per process: every value is 0 once all are done."""
    out = {"gateway in flight": metrics(mesh, "gateway")["kvmesh_gateway_inflight_requests"]}
    for w in prefill:
        m = metrics(mesh, w)
        out[f"{w} leases"] = m["kvmesh_prefill_active_leases"]
        out[f"{w} blocks"] = m["kvmesh_engine_kv_blocks_in_use"]
    for w in decode:
        m = metrics(mesh, w)
        out[f"{w} blocks"] = m["kvmesh_engine_kv_blocks_in_use"]
        out[f"{w} requests"] = m["kvmesh_decode_active_requests"]
    return out


def poll(read: Callable[[], T], done: Callable[[T], bool], polls: int = 100, interval_s: float = 0.1) -> T:
    """``read()`` until ``done`` accepts its value, ``polls`` times at most; the last value read
    (the caller asserts on it, so a timeout shows what was there)."""
    for _ in range(polls):
        value = read()
        if done(value):
            break
        time.sleep(interval_s)
    return value
