"""The all-reduce of tensor-parallel ranks through a torch.distributed process group: NCCL between
GPUs, gloo between CPU processes.

On one machine's CPUs the shared-memory all-reduce (``kvmesh.engine.shm_all_reduce``) is the fast
one; this is the path for ranks on GPUs, where NCCL moves the partial sums between devices without
the host, and for CPU ranks that should not share memory (gloo over TCP). Each engine's group is a
process group object of its own (``ProcessGroupNCCL``/``ProcessGroupGloo`` made directly on a
``TCPStore`` that rank 0 hosts), not torch.distributed's global default group, so one process can
hold several engines' groups (tests do) and nothing global is left when one closes.

A dead peer fails the call, never hangs it: gloo sees the peer's connection close, and every call
is bounded by the group's timeout (NCCL's watchdog aborts a collective past it).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvmesh.engine.rank_order_sum import sum_in_rank_order

BACKENDS = ("gloo", "nccl")


class CollectiveFailed(RuntimeError):
    """A rank is gone, or did not answer within the timeout."""


def host_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous, on a free port of the loopback (``.port`` says which) that the other
    ranks join (``join_store``); it does not wait for them."""
    return dist.TCPStore("127.0.0.1", 0, size, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(port: int, size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, size, False, datetime.timedelta(seconds=timeout_s))


class ProcessGroupAllReduce:
    """Rank ``rank`` of ``size`` in a ``backend`` group on ``store``; tensors live on ``device``.

    ``in_rank_order``: the sum is taken here, in float32 and rank order, over the gathered partial
    sums, so every rank ends with the bits the shared-memory all-reduce gives, whatever the size of
    the tensor (deterministic serving: NCCL picks its reduction algorithm, hence the order of its
    additions, by message size, which depends on the batch). Otherwise the backend sums (NCCL:
    ring or tree, in the tensor's dtype)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        backend: str,
        device: torch.device,
        timeout_s: float,
        in_rank_order: bool = False,
    ) -> None:
        self.rank, self.size, self.device, self.in_rank_order = rank, size, device, in_rank_order
        self._backend = backend
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(store, rank, size, options)
        elif backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self._group = dist.ProcessGroupGloo(store, rank, size, options)
        else:
            raise ValueError(f"no all-reduce backend {backend!r} (one of {', '.join(BACKENDS)})")

    def watch(self, alive: Callable[[], bool]) -> None:
        """Nothing to watch: the backend notices a dead peer itself (a closed connection, or the timeout)."""

    def __call__(self, tensor: torch.Tensor) -> None:
        """Sum the contiguous ``tensor`` over the ranks, in place; CollectiveFailed where a rank is gone."""
        try:
            if not self.in_rank_order:
                self._group.allreduce([tensor]).wait()
                return
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            self._group.allgather([parts], [tensor]).wait()
        except RuntimeError as e:  # DistBackendError, gloo's "Connection closed by peer", a timeout
            raise CollectiveFailed(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        sum_in_rank_order(parts, tensor)

    def close(self) -> None:
        if self._backend == "nccl":
            self._group.shutdown()  # NCCL's communicators are freed explicitly; gloo's sockets close with it
        self._group = None
