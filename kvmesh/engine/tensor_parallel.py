"""Tensor parallelism over processes of one machine: one engine, N ranks.

Rank 0 is the engine's own process: scheduler, sampler, block manager and the KV pool of its heads.
Ranks 1..N-1 are follower processes it starts (``multiprocessing`` spawn): each loads its slice of
the weights (``kvmesh.engine.tp_layout``) and a KV pool of its own heads, then runs every forward
pass rank 0 runs, on the same token ids, positions and block tables, which rank 0 sends it over a
pipe before each pass (``TensorParallelGroup.mirror``). The ranks meet in the two all-reduces of
every layer (gloo on CPU).

The pipes also carry KV blocks, a follower's slice of one at a time, when the engine hands blocks
off (``kvmesh.engine.sharded_kv``). The pipe, not the process group, carries the steps: a follower
waits on it without a deadline while the engine is idle, and sees end-of-file the moment rank 0 goes
away. The all-reduces do have one (``COLLECTIVE_TIMEOUT_S``): a rank that dies mid-step fails the
others' pass instead of hanging it.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.tp_layout import TPLayout
from kvmesh.errors import FailedPrecondition
from kvmesh.runtime.ports import free_port

log = structlog.get_logger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0
_READY = "ready"


class RankLost(RuntimeError):
    """A rank of the group died or stopped answering: the step (and the group) cannot go on."""


class RankLink:
    """This process's place in the group: the all-reduce that sums the ranks' partial products."""

    def __init__(self, rank: int, size: int, port: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timeout)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timeout
        self._group = dist.ProcessGroupGloo(self._store, rank, size, options)
        # Seconds spent in all-reduces so far (waiting for the slowest rank included): bench/tensor_parallel.py.
        self.all_reduce_seconds = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place; RankLost where a rank is gone (its connection closed,
        or no answer within the collective timeout)."""
        t0 = time.perf_counter()
        try:
            self._group.allreduce([tensor]).wait()
        except RuntimeError as e:
            raise RankLost(f"tensor-parallel all-reduce failed: {e}") from None
        self.all_reduce_seconds += time.perf_counter() - t0


class TensorParallelGroup:
    """Rank 0's side: the follower processes, the pipes to them, and rank 0's own link."""

    def __init__(self, processes: list[multiprocessing.Process], pipes: list[Connection], link: RankLink) -> None:
        self._processes, self._pipes, self.link = processes, pipes, link
        # One exchange on the pipes at a time: steps come from the engine thread, block copies from
        # the threads that hand KV off (kvmesh.engine.sharded_kv).
        self._lock = threading.Lock()

    @classmethod
    def start(cls, path: Path, cfg: EngineConfig, threads_per_rank: int) -> TensorParallelGroup:
        """Start ranks 1..N-1 of ``cfg.tensor_parallel_size`` and join them as rank 0 (their weights load
        meanwhile: ``wait_ready``)."""
        size, port = cfg.tensor_parallel_size, free_port()
        context = multiprocessing.get_context("spawn")
        processes, pipes = [], []
        for rank in range(1, size):
            mine, theirs = context.Pipe()
            p = context.Process(
                target=_follower_main,
                args=(theirs, str(path), cfg, rank, port, threads_per_rank),
                name=f"kvmesh-tp-rank-{rank}",
                daemon=True,
            )
            p.start()
            theirs.close()
            processes.append(p)
            pipes.append(mine)
        try:
            link = RankLink(0, size, port)
        except Exception:
            for p in processes:
                p.kill()
            raise
        return cls(processes, pipes, link)

    def wait_ready(self) -> None:
        """Until every follower has loaded its weights; FailedPrecondition with its reason where one failed."""
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                message = pipe.recv()
            except EOFError:
                message = f"exited with code {self._processes[rank - 1].exitcode}"
            if message != _READY:
                self.close()
                raise FailedPrecondition(f"tensor-parallel rank {rank} failed to start: {message}")

    def mirror(self, step: tuple) -> None:
        """Send one forward pass's inputs (token ids, positions, attention metadata) to every follower."""
        with self._lock:
            for rank in range(1, len(self._pipes) + 1):
                self._send(rank, ("step", *step))

    def block_slices(self, block_id: int) -> list[torch.Tensor]:
        """Each follower's slice of KV block ``block_id`` (its KV heads), in rank order."""
        with self._lock:
            for rank in range(1, len(self._pipes) + 1):
                self._send(rank, ("export", block_id))
            return [self._receive(rank) for rank in range(1, len(self._pipes) + 1)]

    def write_block_slices(self, block_id: int, slices: list[torch.Tensor]) -> None:
        """Write each follower its slice of KV block ``block_id`` (in rank order)."""
        with self._lock:
            for rank, part in enumerate(slices, start=1):
                self._send(rank, ("import", block_id, part))

    def _send(self, rank: int, message: tuple) -> None:
        try:
            self._pipes[rank - 1].send(message)
        except OSError:  # BrokenPipeError: the follower exited
            raise self._lost(rank) from None

    def _receive(self, rank: int):
        try:
            return self._pipes[rank - 1].recv()
        except (EOFError, OSError):
            raise self._lost(rank) from None

    def _lost(self, rank: int) -> RankLost:
        return RankLost(f"tensor-parallel rank {rank} is gone (exit code {self._processes[rank - 1].exitcode})")

    def close(self) -> None:
        """Stop the followers (they end at end-of-file on their pipe)."""
        for pipe in self._pipes:
            pipe.close()
        for p in self._processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _follower_main(pipe: Connection, path: str, cfg: EngineConfig, rank: int, port: int, threads: int) -> None:
    """A follower rank: load its slice, then run each forward pass rank 0 sends, until the pipe closes."""
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        link = RankLink(rank, cfg.tensor_parallel_size, port)
        mc = ModelConfig.from_dir(Path(path))
        layout = TPLayout.of(mc, rank, cfg.tensor_parallel_size)
        model, kv = build_rank_model(Path(path), cfg, mc, layout, link)
    except Exception as e:  # the reason goes to rank 0, which refuses to start
        pipe.send(f"{type(e).__name__}: {e}")
        return
    pipe.send(_READY)
    while True:
        try:
            kind, *args = pipe.recv()
        except (EOFError, OSError):
            return
        if kind == "step":
            ids, positions, meta = args
            with torch.inference_mode():
                model.body(ids, positions, kv.tensor, meta)
        elif kind == "export":
            pipe.send(kv.tensor[:, :, args[0]].clone())
        else:  # "import"
            block_id, part = args
            kv.tensor[:, :, block_id].copy_(part)


def build_rank_model(path: Path, cfg: EngineConfig, mc: ModelConfig, layout: TPLayout, link: RankLink):
    """A follower's model slice and KV pool, built as rank 0's ``ModelRunner`` builds its own."""
    from kvmesh.checkpoint.files import weight_files
    from kvmesh.engine.kv_cache import KVCache
    from kvmesh.engine.model import CausalLM

    device, dtype = torch.device(cfg.device), cfg.resolve_dtype(mc.dtype)
    max_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    model = CausalLM(mc, dtype, device, max_len, tp=layout, all_reduce=link.all_reduce)
    model.load_weights(weight_files(path))
    model.to(device).eval()
    if cfg.wants_small_rows_linears(dtype):
        model.use_small_rows_linears()
    kv = KVCache(mc.num_layers, cfg.num_blocks, cfg.block_size, layout.local_kv_heads, mc.head_dim, dtype, device)
    return model, kv
