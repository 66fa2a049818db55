"""Tensor parallelism over processes of one machine: one engine, N ranks.

Rank 0 is the engine's own process: scheduler, sampler, block manager and the KV pool of its heads.
Ranks 1..N-1 are follower processes it starts (``kvmesh.engine.tp_rank``): each loads its slice of
the weights (``kvmesh.engine.tp_layout``) and a KV pool of its own heads, then runs every forward
pass rank 0 runs, on the same token ids, positions and block tables, which rank 0 sends it over a
pipe before each pass (``TensorParallelGroup.mirror``). The ranks meet in the two all-reduces of
every layer and those of the vocab-parallel embedding and LM head: through shared memory on one
machine's CPUs (``kvmesh.engine.shm_all_reduce``), through a torch.distributed process group otherwise
(``kvmesh.engine.process_group_all_reduce``: NCCL between GPUs, rank r on the r-th GPU from the engine's
own; gloo where CPU ranks are asked to use it).

The pipes also carry KV blocks, a follower's slices of every block of a hand-off in one message, when
the engine hands blocks off (``kvmesh.engine.sharded_kv``), and the followers' parts of block checksums.
Beside its pipe each follower has a side channel for a rank service the worker starts on every rank
(``start_rank_service``: each rank's own NIXL agent, ``kvmesh.worker.rank_nixl``), served on a thread of
its own, so that a transfer into a rank's pool never waits behind steps, nor a step behind it.

The pipe, not the process group, carries the steps: a follower waits on it without a deadline while the
engine is idle, and sees end-of-file the moment rank 0 goes away. The all-reduces do have one
(``COLLECTIVE_TIMEOUT_S``), and each side watches the other (rank 0 its children, a follower its parent): a
rank that dies mid-step fails the others' pass at once instead of hanging it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields, is_dataclass, replace
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Protocol

import torch

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.kv_checksum import partial_block_checksums
from kvmesh.engine.process_group_all_reduce import CollectiveFailed, ProcessGroupAllReduce, host_store, join_store
from kvmesh.engine.shm_all_reduce import RankGone, ShmAllReduce, create_memory
from kvmesh.engine.tp_layout import TPLayout
from kvmesh.engine.traced_all_reduce import forget, register
from kvmesh.errors import FailedPrecondition

COLLECTIVE_TIMEOUT_S = 60.0
_READY = "ready"


class RankLost(RuntimeError):
    """A rank of the group died or stopped answering: the step (and the group) cannot go on."""


class AllReduce(Protocol):
    """How the ranks sum their partial products: ``ShmAllReduce`` or ``ProcessGroupAllReduce``."""

    def __call__(self, tensor: torch.Tensor) -> None: ...

    def watch(self, alive: Callable[[], bool]) -> None: ...

    def close(self) -> None: ...


class RankLink:
    """This process's place in the group: the all-reduce that sums the ranks' partial products. A process
    group's is attached once every rank has loaded its weights (its rendezvous waits for all of them)."""

    def __init__(self) -> None:
        self._reduce: AllReduce | None = None
        # Seconds spent in all-reduces so far (waiting for the slowest rank included): bench/tensor_parallel.py.
        self.all_reduce_seconds = 0.0
        self._alone = False
        self._number = register(self)  # what a compiled graph's all-reduce op calls this link by

    def attach(self, reduce: AllReduce, alive: Callable[[], bool]) -> None:
        """Sum through ``reduce``; while waiting in it, give up at once (RankLost) when ``alive()`` turns
        False (where the all-reduce waits on its own: the shared-memory one)."""
        reduce.watch(alive)
        self._reduce = reduce

    def model_all_reduce(self, tensor: torch.Tensor) -> None:
        """``all_reduce`` as the model calls it: one op of the graph while dynamo traces a compiled step
        (``kvmesh.engine.traced_all_reduce``), a direct call (no dispatcher) otherwise."""
        if torch.compiler.is_compiling():
            torch.ops.kvmesh.tp_all_reduce_(tensor, self._number)
        else:
            self.all_reduce(tensor)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place; RankLost where a rank is gone (dead, or no answer
        within the collective timeout)."""
        if self._alone:
            return
        t0 = time.perf_counter()
        try:
            self._reduce(tensor)
        except (RankGone, CollectiveFailed) as e:
            raise RankLost(f"tensor-parallel all-reduce failed: {e}") from None
        self.all_reduce_seconds += time.perf_counter() - t0

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Sum nothing while in it: each rank warms its compiled graphs up by itself (synthetic steps whose
        sums nobody reads), at its own pace, with no rank waiting in a collective on another's compiler.
        Only at start-up, when nothing else runs a step on this link (so it need not nest)."""
        self._alone = True
        try:
            yield
        finally:
            self._alone = False

    def close(self) -> None:
        forget(self._number)
        if self._reduce is not None:
            self._reduce.close()


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU for every rank of a CPU engine; on CUDA, the GPU ``rank`` places
    after the engine's own (``cuda`` is ``cuda:0``)."""
    d = torch.device(device)
    return d if d.type == "cpu" else torch.device(d.type, (d.index or 0) + rank)


class TensorParallelGroup:
    """Rank 0's side: the follower processes, the pipes to them, and rank 0's own link."""

    def __init__(
        self,
        processes: list[subprocess.Popen],
        pipes: list[Connection],
        sides: list[Connection],
        link: RankLink,
        join: Callable[[], AllReduce] | None,
        device: torch.device,
    ) -> None:
        self._processes, self._pipes, self.link = processes, pipes, link
        self._sides = sides  # each follower's side channel: one call at a time on each
        self._side_locks = [threading.Lock() for _ in sides]
        self._join = join  # rank 0's place in a process group, joined once every rank is ready
        # Tensors cross the pipes on the host: pickled CUDA tensors would unpickle on the sender's GPU.
        self._on_host = device.type != "cpu"
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
        size, backend = cfg.tensor_parallel_size, cfg.resolve_tp_all_reduce()
        # Shared memory: the children inherit the memory file, which goes when the last rank does.
        # A process group: the ranks meet at a store this process hosts.
        memory = create_memory(size) if backend == "shm" else None
        store = host_store(size, COLLECTIVE_TIMEOUT_S) if memory is None else None
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank)}
        processes, pipes, sides, link = [], [], [], RankLink()

        def alive() -> bool:
            return all(p.poll() is None for p in processes)

        try:
            if memory is not None:
                link.attach(ShmAllReduce(memory, 0, size, COLLECTIVE_TIMEOUT_S), alive)
            meeting = memory if memory is not None else store.port
            for rank in range(1, size):
                mine, theirs = socket.socketpair()
                side_mine, side_theirs = socket.socketpair()
                fds = [theirs.fileno(), side_theirs.fileno()]
                argv = [sys.executable, "-m", "kvmesh.engine.tp_rank", *map(str, fds)]
                inherited = fds + ([memory] if memory is not None else [])
                processes.append(subprocess.Popen(argv, pass_fds=inherited, env=env))
                theirs.close()
                side_theirs.close()
                pipes.append(Connection(mine.detach()))
                sides.append(Connection(side_mine.detach()))
                pipes[-1].send_bytes(_pack((str(path), cfg, rank, meeting, threads_per_rank)))
        except Exception:
            for p in processes:
                p.kill()
            raise
        finally:
            if memory is not None:
                os.close(memory)  # mapped here and inherited there
        device = rank_device(cfg.device, 0)
        join = partial(_group_all_reduce, store, 0, cfg, device) if store is not None else None
        return cls(processes, pipes, sides, link, join, device)

    def wait_ready(self) -> None:
        """Until every follower has loaded its weights; FailedPrecondition with its reason where one failed."""
        for rank in range(1, len(self._pipes) + 1):
            message = self._reply(rank)
            if message != _READY:
                self.close()
                raise FailedPrecondition(f"tensor-parallel rank {rank} failed to start: {message}")
        if self._join is not None:
            try:
                self.link.attach(self._join(), lambda: True)
            except Exception as e:
                self.close()
                raise FailedPrecondition(f"tensor-parallel ranks failed to meet: {e}") from None

    def compile_decode(self, settings: Mapping[str, object], compile_own: Callable[[], None]) -> None:
        """Compile every rank's decode graphs (``kvmesh.engine.compile``), all at once, each rank alone:
        the followers from ``settings`` (each adds its rank and pool), rank 0 by ``compile_own``.
        FailedPrecondition with its reason where a follower failed or died; either way the group is closed
        (its followers killed: one still compiling reads nothing)."""
        try:
            with self._lock:
                for rank in range(1, len(self._pipes) + 1):
                    self._send(rank, ("compile", dict(settings)))
                with self.link.alone():
                    compile_own()
                for rank in range(1, len(self._pipes) + 1):
                    message = self._reply(rank)
                    if message != _READY:
                        raise FailedPrecondition(f"tensor-parallel rank {rank} failed to compile: {message}")
        except BaseException as e:
            for p in self._processes:
                p.kill()
            self.close()
            if isinstance(e, RankLost):
                raise FailedPrecondition(f"tensor-parallel rank failed while compiling: {e}") from None
            raise

    def mirror(self, step: tuple) -> None:
        """Send one forward pass's inputs (token ids, positions, attention metadata, LoRA binding, the rows
        that sample) to every follower."""
        message = ("step", *(_moved(step, "cpu") if self._on_host else step))
        with self._lock:
            for rank in range(1, len(self._pipes) + 1):
                self._send(rank, message)

    def send_lora_slot(self, rank: int, slot: int, factors: dict) -> None:
        """Give follower ``rank`` its part of a LoRA slot's factors (``kvmesh.engine.lora``)."""
        with self._lock:
            self._send(rank, ("lora", slot, _moved(factors, "cpu") if self._on_host else factors))

    def block_slices(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Each follower's slice (its KV heads) of KV blocks ``block_ids``, stacked on dim 2 in that order:
        one tensor a follower, in rank order, on the host. One exchange a rank, whatever the count."""
        with self._lock:
            for rank in range(1, len(self._pipes) + 1):
                self._send(rank, ("export", block_ids))
            return [self._receive(rank) for rank in range(1, len(self._pipes) + 1)]

    def block_checksum_parts(self, ranks: list[int], block_ids: list[int]) -> list[list[int]]:
        """Followers ``ranks``' parts of the checksums of blocks ``block_ids`` (``kvmesh.engine.kv_checksum``),
        in that order: one exchange a rank."""
        with self._lock:
            for rank in ranks:
                self._send(rank, ("checksums", block_ids))
            return [self._receive(rank) for rank in ranks]

    def start_rank_service(self, module: str, settings: Mapping[str, object]) -> list[object]:
        """Start ``module``'s ``serve_rank`` on every follower (it answers calls on the rank's side channel from
        then on, on a thread of its own, and ends on ``("close",)``); what each follower's start gave, in rank
        order. FailedPrecondition with its reason where one failed: the others' are closed."""
        with self._lock:
            for rank in range(1, len(self._pipes) + 1):
                self._send(rank, ("service", module, dict(settings)))
            replies = [self._receive(rank) for rank in range(1, len(self._pipes) + 1)]
        failed = [(rank, reply) for rank, reply in enumerate(replies, start=1) if isinstance(reply, str)]
        if failed:
            for rank, reply in enumerate(replies, start=1):
                if not isinstance(reply, str):
                    self.side_call(rank, ("close",))
            rank, reason = failed[0]
            raise FailedPrecondition(f"tensor-parallel rank {rank} could not start {module}: {reason}")
        return [reply[0] for reply in replies]

    def side_call(self, rank: int, message: object) -> object:
        """One call to follower ``rank``'s rank service and its answer (blocking: call it off the event loop).
        RankLost where the follower is gone."""
        with self._side_locks[rank - 1]:
            try:
                self._sides[rank - 1].send_bytes(_pack(message))
                return _unpack(self._sides[rank - 1].recv_bytes())
            except (EOFError, OSError):
                raise self._lost(rank) from None

    def write_block_slices(self, block_ids: list[int], slices: list[torch.Tensor]) -> None:
        """Write each follower its slice of KV blocks ``block_ids`` (host tensors stacked on dim 2 as
        ``block_slices`` gives them, in rank order)."""
        with self._lock:
            for rank, part in enumerate(slices, start=1):
                self._send(rank, ("import", block_ids, part))

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

    def _reply(self, rank: int) -> str:
        """A follower's answer to a start or a compile: ``_READY``, its reason, or why it is gone."""
        try:
            return self._receive(rank)
        except RankLost as e:
            return str(e)

    def _lost(self, rank: int) -> RankLost:
        return RankLost(f"tensor-parallel rank {rank} is gone (exit code {self._processes[rank - 1].poll()})")

    def close(self) -> None:
        """Stop the followers (they end at end-of-file on their pipe)."""
        for pipe in [*self._pipes, *self._sides]:
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


def _group_all_reduce(
    store: torch.distributed.Store, rank: int, cfg: EngineConfig, device: torch.device
) -> ProcessGroupAllReduce:
    """Rank ``rank``'s place in the process group of ``cfg``'s all-reduce, met at ``store``: the sum in rank
    order under deterministic serving, as the shared-memory all-reduce gives it."""
    return ProcessGroupAllReduce(
        store,
        rank,
        cfg.tensor_parallel_size,
        cfg.resolve_tp_all_reduce(),
        device,
        COLLECTIVE_TIMEOUT_S,
        in_rank_order=cfg.deterministic,
    )


def _moved(obj: object, device: torch.device | str) -> object:
    """``obj`` (tensors, and tuples, lists, dicts and dataclasses of them) with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_moved(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: _moved(getattr(obj, f.name), device) for f in fields(obj) if f.init})
    return obj


def follower_main(fd: int, side_fd: int) -> None:
    """A follower rank (``kvmesh.engine.tp_rank``): read its part from rank 0 over the socket ``fd``, load
    its slice, then run each forward pass and block copy rank 0 sends, until the socket closes. ``side_fd``
    is the side channel of a rank service rank 0 may start (``TensorParallelGroup.start_rank_service``)."""
    pipe, side = Connection(fd), Connection(side_fd)
    try:
        path, cfg, rank, meeting, threads = _unpack(pipe.recv_bytes())
    except (EOFError, OSError):
        return
    torch.set_num_threads(threads)
    parent = os.getppid()
    _exit_when_orphaned(parent)
    size, backend, device = cfg.tensor_parallel_size, cfg.resolve_tp_all_reduce(), rank_device(cfg.device, rank)
    link = RankLink()
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # kernels launch on the current device
        if backend == "shm":
            link.attach(ShmAllReduce(meeting, rank, size, COLLECTIVE_TIMEOUT_S), lambda: os.getppid() == parent)
            os.close(meeting)  # mapped
        mc = ModelConfig.from_dir(Path(path))
        layout = TPLayout.of(mc, rank, size, cfg.expert_parallel)
        model, kv = build_rank_model(Path(path), cfg, mc, layout, device, link)
    except Exception as e:  # the reason goes to rank 0, which refuses to start
        pipe.send_bytes(_pack(f"{type(e).__name__}: {e}"))
        return
    pipe.send_bytes(_pack(_READY))
    if backend != "shm":  # every rank is ready: meet rank 0 in the group (it fails the start if this fails)
        try:
            group = _group_all_reduce(join_store(meeting, size, COLLECTIVE_TIMEOUT_S), rank, cfg, device)
        except Exception:
            return
        link.attach(group, lambda: True)
    on_host = device.type != "cpu"
    while True:
        try:
            kind, *args = _unpack(pipe.recv_bytes())
        except (EOFError, OSError):
            return
        if on_host and kind != "export":
            args = _moved(args, device)
        if kind == "step":
            ids, positions, meta, lora, logits_indices = args
            if model.lora is not None:
                model.lora.bind(lora)
            with torch.inference_mode():  # the head too: its vocabulary rows (CausalLM.head_rows)
                model.step(ids, positions, kv.tensor, meta, logits_indices)
        elif kind == "compile":
            pipe.send_bytes(_pack(_compile_rank(model, kv.tensor, args[0], link, rank, size, device)))
        elif kind == "lora":
            model.lora.write_slot(*args)
        elif kind == "export":
            pipe.send_bytes(_pack(kv.tensor[:, :, args[0]].cpu()))  # a list of ids: a copy
        elif kind == "checksums":
            first, _ = layout.kv_head_range()
            pipe.send_bytes(_pack(partial_block_checksums(kv.tensor, args[0], first, mc.num_kv_heads)))
        elif kind == "service":
            pipe.send_bytes(_pack(_start_service(side, kv.tensor, layout, mc.num_kv_heads, *args)))
        else:  # "import"
            block_ids, part = args
            kv.tensor[:, :, block_ids] = part


def _start_service(
    side: Connection, pool: torch.Tensor, layout: TPLayout, total_kv_heads: int, module: str, settings: dict
) -> tuple[object] | str:
    """Start ``module.serve_rank`` on this rank's side channel: ``(what it gave,)``, or why it failed."""
    first, _ = layout.kv_head_range()
    try:
        serve_rank = importlib.import_module(module).serve_rank
        return (serve_rank(side, pool, first, total_kv_heads, settings),)
    except Exception as e:  # noqa: BLE001 - the reason goes to rank 0, which fails the worker's start
        return f"{type(e).__name__}: {e}"


def _exit_when_orphaned(parent: int) -> None:
    """End this follower soon after rank 0's process is gone, whatever it is doing: between steps it sees
    end-of-file on its pipe, but loading weights or compiling (minutes on CPU) it reads nothing, and a
    compile left running holds its cache folder's lock against the restarted group's rank."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _compile_rank(
    model: torch.nn.Module,
    kv_cache: torch.Tensor,
    settings: dict[str, object],
    link: RankLink,
    rank: int,
    size: int,
    device: torch.device,
) -> str:
    """A follower's decode graphs, compiled alone (``RankLink.alone``) from rank 0's ``settings`` with what
    is this rank's own (its cache folder's key): ``_READY``, or why not."""
    from kvmesh.engine.compile import compile_decode

    own = {
        "tensor_parallel": [rank, size],
        "device": str(device),
        "kv_pool": list(kv_cache.shape),
        "threads": torch.get_num_threads(),
    }
    try:
        with link.alone():
            compile_decode(model, kv_cache, {**settings, **own}, recompile=False)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return _READY


def build_rank_model(
    path: Path, cfg: EngineConfig, mc: ModelConfig, layout: TPLayout, device: torch.device, link: RankLink
):
    """A follower's model slice and KV pool on ``device``, built as rank 0's ``ModelRunner`` builds its own."""
    from kvmesh.checkpoint.compressed import checkpoint_tensors
    from kvmesh.checkpoint.files import weight_files
    from kvmesh.engine.families import model_class
    from kvmesh.engine.kv_cache import KVCache
    from kvmesh.engine.lora import LoraSlots

    dtype = cfg.resolve_dtype(mc.dtype)
    max_len = cfg.resolve_max_model_len(mc.max_position_embeddings)
    model = model_class(mc)(mc, dtype, device, max_len, tp=layout, all_reduce=link.model_all_reduce)
    files = weight_files(path)
    model.load_weights(partial(checkpoint_tensors, mc.raw, files))
    model.to(device).eval()
    if cfg.deterministic:
        model.make_batch_invariant()
    if cfg.quantization is not None:  # each rank its slice: a row-parallel slice's rows get scales of their own
        model.quantize(cfg.quantization, head=cfg.quantize_lm_head)
    if cfg.wants_small_rows_linears(dtype):
        model.use_small_rows_linears()
    if cfg.max_loras > 0:  # rank 0 fills the slots
        model.use_lora(LoraSlots(dtype, device, cfg.max_loras))
    kv = KVCache(
        mc.num_layers,
        cfg.num_blocks,
        cfg.block_size,
        layout.local_kv_heads,
        mc.head_dim,
        dtype,
        device,
        mc.kv_components,
    )
    return model, kv
