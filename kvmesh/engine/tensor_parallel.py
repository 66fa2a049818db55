"""Tensor parallelism over processes of one machine: one engine, N ranks.

Rank 0 is the engine's own process: scheduler, sampler, block manager and the KV pool of its heads.
Ranks 1..N-1 are follower processes it starts (``kvmesh.engine.tp_rank``): each loads its slice of
the weights (``kvmesh.engine.tp_layout``) and a KV pool of its own heads, then runs every forward
pass rank 0 runs, on the same token ids, positions and block tables, which rank 0 sends it over a
pipe before each pass (``TensorParallelGroup.mirror``). The ranks meet in the two all-reduces of
every layer, through shared memory (``kvmesh.engine.shm_all_reduce``).

The pipes also carry KV blocks, a follower's slice of one at a time, when the engine hands blocks
off (``kvmesh.engine.sharded_kv``). The pipe, not the process group, carries the steps: a follower
waits on it without a deadline while the engine is idle, and sees end-of-file the moment rank 0 goes
away. The all-reduces do have one (``COLLECTIVE_TIMEOUT_S``), and each side watches the other (rank 0
its children, a follower its parent): a rank that dies mid-step fails the others' pass at once instead
of hanging it.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.shm_all_reduce import RankGone, ShmAllReduce, create_memory
from kvmesh.engine.tp_layout import TPLayout
from kvmesh.errors import FailedPrecondition

COLLECTIVE_TIMEOUT_S = 60.0
_READY = "ready"


class RankLost(RuntimeError):
    """A rank of the group died or stopped answering: the step (and the group) cannot go on."""


class RankLink:
    """This process's place in the group: the all-reduce that sums the ranks' partial products
    (``kvmesh.engine.shm_all_reduce``: the ranks share this machine's memory)."""

    def __init__(self, rank: int, size: int, memory_fd: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self._reduce = ShmAllReduce(memory_fd, rank, size, timeout_s)
        # Seconds spent in all-reduces so far (waiting for the slowest rank included): bench/tensor_parallel.py.
        self.all_reduce_seconds = 0.0

    def watch(self, alive: Callable[[], bool]) -> None:
        """While waiting in an all-reduce, give up at once (RankLost) when ``alive()`` turns False."""
        self._reduce.alive = alive

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place; RankLost where a rank is gone (dead, or no answer
        within the collective timeout)."""
        t0 = time.perf_counter()
        try:
            self._reduce(tensor)
        except RankGone as e:
            raise RankLost(f"tensor-parallel all-reduce failed: {e}") from None
        self.all_reduce_seconds += time.perf_counter() - t0

    def close(self) -> None:
        self._reduce.close()


class TensorParallelGroup:
    """Rank 0's side: the follower processes, the pipes to them, and rank 0's own link."""

    def __init__(self, processes: list[subprocess.Popen], pipes: list[Connection], link: RankLink) -> None:
        self._processes, self._pipes, self.link = processes, pipes, link
        # One exchange on the pipes at a time: steps come from the engine thread, block copies from
        # the threads that hand KV off (kvmesh.engine.sharded_kv).
        self._lock = threading.Lock()

    @classmethod
    def start(cls, path: Path, cfg: EngineConfig, threads_per_rank: int) -> TensorParallelGroup:
        """Start ranks 1..N-1 of ``cfg.tensor_parallel_size`` and join them as rank 0 (their weights load
        meanwhile: ``wait_ready``).

        Each is ``python -m kvmesh.engine.tp_rank`` with one end of a socket pair, not a multiprocessing
        child: a spawned child re-runs the parent's main script, which a script without a main guard (or a
        service's entry point) must not have done to it."""
        size = cfg.tensor_parallel_size
        memory = create_memory(size)  # the children inherit it; it goes when the last rank does
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank)}
        processes, pipes = [], []
        try:
            link = RankLink(0, size, memory)
            for rank in range(1, size):
                mine, theirs = socket.socketpair()
                argv = [sys.executable, "-m", "kvmesh.engine.tp_rank", str(theirs.fileno())]
                processes.append(subprocess.Popen(argv, pass_fds=[theirs.fileno(), memory], env=env))
                theirs.close()
                pipes.append(Connection(mine.detach()))
                pipes[-1].send_bytes(_pack((str(path), cfg, rank, memory, threads_per_rank)))
        except Exception:
            for p in processes:
                p.kill()
            raise
        finally:
            os.close(memory)  # mapped here and inherited there
        link.watch(lambda: all(p.poll() is None for p in processes))
        return cls(processes, pipes, link)

    def wait_ready(self) -> None:
        """Until every follower has loaded its weights; FailedPrecondition with its reason where one failed."""
        for rank in range(1, len(self._pipes) + 1):
            try:
                message = self._receive(rank)
            except RankLost as e:
                message = str(e)
            if message != _READY:
                self.close()
                raise FailedPrecondition(f"tensor-parallel rank {rank} failed to start: {message}")

    def mirror(self, step: tuple) -> None:
        """Send one forward pass's inputs (token ids, positions, attention metadata, LoRA binding) to every
        follower."""
        with self._lock:
            for rank in range(1, len(self._pipes) + 1):
                self._send(rank, ("step", *step))

    def send_lora_slot(self, rank: int, slot: int, factors: dict) -> None:
        """Give follower ``rank`` its part of a LoRA slot's factors (``kvmesh.engine.lora``)."""
        with self._lock:
            self._send(rank, ("lora", slot, factors))

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
            self._pipes[rank - 1].send_bytes(_pack(message))
        except OSError:  # BrokenPipeError: the follower exited
            raise self._lost(rank) from None

    def _receive(self, rank: int):
        try:
            return _unpack(self._pipes[rank - 1].recv_bytes())
        except (EOFError, OSError):
            raise self._lost(rank) from None

    def _lost(self, rank: int) -> RankLost:
        return RankLost(f"tensor-parallel rank {rank} is gone (exit code {self._processes[rank - 1].poll()})")

    def close(self) -> None:
        """Stop the followers (they end at end-of-file on their pipe)."""
        for pipe in self._pipes:
            pipe.close()
        for p in self._processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.link.close()


def _pack(message: object) -> bytes:
    """A message as plain pickle bytes. Sent as objects, tensors would go through torch's multiprocessing
    reductions, which move each into a shared-memory segment of its own: milliseconds a step."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _unpack(data: bytes) -> object:
    return pickle.loads(data)


def follower_main(fd: int) -> None:
    """A follower rank (``kvmesh.engine.tp_rank``): read its part from rank 0 over the socket ``fd``, load
    its slice, then run each forward pass and block copy rank 0 sends, until the socket closes."""
    pipe = Connection(fd)
    try:
        path, cfg, rank, memory, threads = _unpack(pipe.recv_bytes())
    except (EOFError, OSError):
        return
    torch.set_num_threads(threads)
    parent = os.getppid()
    try:
        link = RankLink(rank, cfg.tensor_parallel_size, memory)
        os.close(memory)  # mapped
        link.watch(lambda: os.getppid() == parent)  # rank 0 gone: stop waiting for it
        mc = ModelConfig.from_dir(Path(path))
        layout = TPLayout.of(mc, rank, cfg.tensor_parallel_size)
        model, kv = build_rank_model(Path(path), cfg, mc, layout, link)
    except Exception as e:  # the reason goes to rank 0, which refuses to start
        pipe.send_bytes(_pack(f"{type(e).__name__}: {e}"))
        return
    pipe.send_bytes(_pack(_READY))
    while True:
        try:
            kind, *args = _unpack(pipe.recv_bytes())
        except (EOFError, OSError):
            return
        if kind == "step":
            ids, positions, meta, lora = args
            if model.lora is not None:
                model.lora.bind(lora)
            with torch.inference_mode():
                model.body(ids, positions, kv.tensor, meta)
        elif kind == "lora":
            model.lora.write_slot(*args)
        elif kind == "export":
            pipe.send_bytes(_pack(kv.tensor[:, :, args[0]].clone()))
        else:  # "import"
            block_id, part = args
            kv.tensor[:, :, block_id].copy_(part)


def build_rank_model(path: Path, cfg: EngineConfig, mc: ModelConfig, layout: TPLayout, link: RankLink):
    """A follower's model slice and KV pool, built as rank 0's ``ModelRunner`` builds its own."""
    from kvmesh.checkpoint.compressed import dequantized_tensors
    from kvmesh.checkpoint.files import weight_files
    from kvmesh.engine.kv_cache import KVCache
    from kvmesh.engine.lora import LoraSlots
    from kvmesh.engine.model import CausalLM

    device, dtype = torch.device(cfg.device), cfg.resolve_dtype(mc.dtype)
    max_len = cfg.resolve_max_model_len(mc.max_position_embeddings)
    model = CausalLM(mc, dtype, device, max_len, tp=layout, all_reduce=link.all_reduce)
    files = weight_files(path)
    model.load_weights(files, dequantized_tensors(mc.raw, files))
    model.to(device).eval()
    if cfg.deterministic:
        model.make_batch_invariant()
    if cfg.quantization is not None:  # each rank its slice: a row-parallel slice's rows get scales of their own
        model.quantize(cfg.quantization)
    if cfg.wants_small_rows_linears(dtype):
        model.use_small_rows_linears()
    if cfg.max_loras > 0:  # rank 0 fills the slots
        model.use_lora(LoraSlots(dtype, device, cfg.max_loras))
    kv = KVCache(mc.num_layers, cfg.num_blocks, cfg.block_size, layout.local_kv_heads, mc.head_dim, dtype, device)
    return model, kv
