"""Free local ports, for processes this one starts (a mesh, tensor-parallel ranks, tests)."""

from __future__ import annotations

import random
import socket

# Below Linux's default ephemeral range (32768-60999). A port the OS hands out for bind(0) comes from
# that range, as does the source port of every outgoing connection: a port picked there can be taken by
# some connection before the service it was picked for binds it ("address already in use", seen in CI).
_LOW, _HIGH = 15000, 32767
_TRIES = 64
_handed_out: set[int] = set()  # never the same port twice from this process


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, outside the ephemeral range (the OS may still hand it out
    again later; good enough locally)."""
    for _ in range(_TRIES):
        port = random.randint(_LOW, _HIGH)
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
