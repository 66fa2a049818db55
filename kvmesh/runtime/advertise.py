"""The address a service tells its peers to reach it at: what a worker registers with the router."""

from __future__ import annotations

import socket

# Hosts that bind every interface: a peer cannot dial them.
WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})


def advertised_address(host: str, port: int, advertise: str | None) -> str:
    """``--advertise-address`` when given, else ``host:port``; a wildcard ``host`` (every interface) becomes
    the address this machine's name resolves to (in Kubernetes a pod's hostname resolves to its pod IP)."""
    if advertise:
        return advertise
    if host in WILDCARDS:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError as e:
            raise ValueError(
                f"--host {host or '(empty)'} binds every interface and this machine's name does not resolve "
                f"({e}): set --advertise-address to the host:port peers reach this service at"
            ) from None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
