"""The ranks' all-reduce as a step a compiled graph can hold: ``kvmesh::tp_all_reduce_``.

A compiled decode step (``kvmesh.engine.compile``) traces the model's forward; the all-reduce is Python
that waits on shared memory or a process group, which dynamo would break the graph at (two breaks a
layer: a graph per piece between them). As an opaque in-place custom op it stays one node of one graph,
which calls the rank's ``RankLink`` when the graph runs. The op names the link by a number, since an op's
arguments are tensors and plain values (``RankLink.model_all_reduce`` calls it while dynamo traces; eager
steps call the link directly and skip the dispatcher).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import Protocol

import torch


class Summing(Protocol):
    """What the op calls: a rank's ``RankLink``."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...


# Weak: a link whose group never closed (a start that failed) goes with its last user, as before the op.
_links: weakref.WeakValueDictionary[int, Summing] = weakref.WeakValueDictionary()
_numbers = itertools.count(1)
_raised = threading.local()  # .error: what the op last raised in this thread, for ``failures_as_raised``


@torch.library.custom_op("kvmesh::tp_all_reduce_", mutates_args={"tensor"})
def _tp_all_reduce_(tensor: torch.Tensor, link: int) -> None:
    try:
        _links[link].all_reduce(tensor)
    except Exception as e:
        _raised.error = e
        raise


@_tp_all_reduce_.register_fake
def _(tensor: torch.Tensor, link: int) -> None:
    return None


def register(link: Summing) -> int:
    """The number ``tp_all_reduce_`` knows ``link`` by, until ``forget``."""
    number = next(_numbers)
    _links[number] = link
    return number


def forget(number: int) -> None:
    """``number`` names no link any more (its group closed)."""
    _links.pop(number, None)


@contextlib.contextmanager
def failures_as_raised() -> Iterator[None]:
    """Around a compiled graph's call: what its all-reduce raised (RankLost) comes out as itself, not as the
    RuntimeError inductor's C++ wrapper turns a Python op's exception into."""
    _raised.error = None
    try:
        yield
    except RuntimeError:
        error, _raised.error = _raised.error, None
        if error is not None:
            raise error from None
        raise
