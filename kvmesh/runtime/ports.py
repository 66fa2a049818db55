"""Free local ports, for processes this one starts (a mesh, tensor-parallel ranks, tests)."""

from __future__ import annotations

import os
import random
import socket

# Below Linux's default ephemeral range (32768-60999). A port the OS hands out for bind(0) comes from
# that range, as does the source port of every outgoing connection: a port picked there can be taken by
# some connection before the service it was picked for binds it ("address already in use", seen in CI).
_LOW, _HIGH = 15000, 32767
# "LOW-HIGH": a slice of that range for this process and its children. Processes that pick ports side
# by side (the test runners of one parallel run) each take their own slice: a port one of them picked is
# free until its service binds it, so the other could pick it too.
PORT_RANGE_ENV = "KVMESH_FREE_PORT_RANGE"
_TRIES = 64
_handed_out: set[int] = set()  # never the same port twice from this process


def port_range() -> tuple[int, int]:
    """The ports ``free_port`` picks from: the slice ``KVMESH_FREE_PORT_RANGE`` names, else all of them."""
    value = os.environ.get(PORT_RANGE_ENV)
    if not value:
        return _LOW, _HIGH
    low, _, high = value.partition("-")
    if not (low.isdigit() and high.isdigit() and _LOW <= int(low) < int(high) <= _HIGH):
        raise ValueError(f"{PORT_RANGE_ENV}={value!r}: expected LOW-HIGH within {_LOW}-{_HIGH}")
    return int(low), int(high)


def port_slice(index: int, count: int) -> str:
    """The ``index``-th of ``count`` disjoint slices of the range, as ``KVMESH_FREE_PORT_RANGE`` takes it."""
    width = (_HIGH - _LOW + 1) // count
    return f"{_LOW + index * width}-{_LOW + (index + 1) * width - 1}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, outside the ephemeral range (the OS may still hand it out
    again later; good enough locally)."""
    low, high = port_range()
    for _ in range(_TRIES):
        port = random.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # the low range is crowded: whatever the OS gives
        s.bind((host, 0))
        return s.getsockname()[1]
