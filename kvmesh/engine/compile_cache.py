"""Where compiled decode graphs persist between starts, and how workers share them.

torch.compile keeps what it builds (inductor's FX graph and AOT autograd caches, the C++ and
Triton binaries) in one cache folder. A worker compiles into a folder of its own configuration,
``<cache>/compile/<key>``, where the key hashes everything a graph's validity depends on that
the compiler's own keys may not see: the model's fingerprint (weights, dtype, block size,
quantization), the KV pool's shape, the engine flags that change the traced code, and the
versions of Python, torch and triton and of our kernels. A configuration that does not match
gets another folder, so a stale graph is never looked up; inside a folder torch's own keys
decide per graph.

Workers of one machine share the folders (``$KVMESH_COMPILE_CACHE``, else
``$KVMESH_CACHE/compile``). One lock per folder serializes compiles into it: a worker that
starts while another compiles the same configuration waits, then finds the graphs built,
rather than both spending the CPU on the same work. Every file in the folder is written
atomically by torch, so a reader never sees half a graph.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import structlog
import torch

import kernels
from kvmesh.models.catalog import cache_dir

log = structlog.get_logger(__name__)

_KERNELS = Path(kernels.__file__).resolve().parent


def compile_cache_root() -> Path:
    explicit = os.environ.get("KVMESH_COMPILE_CACHE")
    return Path(explicit).expanduser() if explicit else cache_dir() / "compile"


def kernels_id() -> str:
    """A hash of our kernels' sources: a compiled graph calls them (CPU ops) or inlines them (Triton)."""
    h = hashlib.sha256()
    for f in sorted(p for p in _KERNELS.rglob("*") if p.suffix in {".py", ".cpp", ".h"}):
        h.update(f.relative_to(_KERNELS).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def compile_key(settings: Mapping[str, object]) -> dict[str, object]:
    """What a compiled graph's validity depends on: ``settings`` (the model and the engine's
    flags that shape the traced code) and the toolchain."""
    import triton

    return {
        **settings,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "kernels": kernels_id(),
        "machine": platform.machine(),
    }


def key_folder(root: Path, key: Mapping[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return root / digest[:24]


@contextlib.contextmanager
def compile_cache(key: Mapping[str, object], root: Path | None = None) -> Iterator[Path]:
    """Compile into the folder of ``key`` (created on first use), holding its lock meanwhile."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    folder = key_folder(root or compile_cache_root(), key)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "key.json").write_text(json.dumps(key, sort_keys=True, indent=1, default=str) + "\n")
    with open(folder / "lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another worker compiling the same graphs", cache=str(folder))
            waited = time.perf_counter()
            fcntl.flock(lock, fcntl.LOCK_EX)
            waited_s = round(time.perf_counter() - waited, 1)
            log.info("the other worker is done; loading its graphs", cache=str(folder), waited_s=waited_s)
        try:
            with temporary_cache_dir(str(folder / "inductor")):
                yield folder
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def compiled_graph_counts() -> dict[str, int]:
    """Graphs inductor compiled and stored (``compiled``), found in the cache (``cached``), or compiled
    without storing them (``uncacheable``: torch cannot store a graph holding oneDNN-packed weights,
    which the frozen float32/bf16 CPU graphs do; docs/compile.md) in this process so far."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return {
        "compiled": c["fxgraph_cache_miss"],
        "cached": c["fxgraph_cache_hit"],
        "uncacheable": c["fxgraph_cache_bypass"],
    }
