"""Free local ports, for processes this one starts (a mesh, tensor-parallel ranks, tests)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS may hand it out again later; good enough locally)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
