"""Toxiproxy on a host of a ``netns.Network``: a TCP proxy in front of a service, with faults on demand.

A service advertises the proxy's address instead of its own (``--advertise-address``), so every peer that
reaches it through the router's directory (the gateway's Prefill calls, decode's KV pulls over gRPC) goes
through the proxy, while the service itself runs unchanged. Toxics then act on that link only: ``latency``
(added milliseconds each way), ``reset_peer`` (connections reset, at once or after a delay), ``timeout``
(a black hole). The proxy is Shopify's Toxiproxy (``scripts/install_fault_tools.sh`` builds it into
``.tools/bin``); this is a client of its HTTP API plus the process, started inside the host's namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvmesh.launcher.compose import REPO_ROOT
from kvmesh.launcher.netns import Network
from kvmesh.launcher.supervisor import EXEC_CHILD
from kvmesh.runtime.ports import free_port

BUILT = REPO_ROOT / ".tools" / "bin" / "toxiproxy-server"
_START_TIMEOUT_S = 10.0


def toxiproxy_binary() -> Path | None:
    """The Toxiproxy server: ``KVMESH_TOXIPROXY``, the one scripts/install_fault_tools.sh built, or on PATH."""
    if os.environ.get("KVMESH_TOXIPROXY"):
        return Path(os.environ["KVMESH_TOXIPROXY"])
    if BUILT.exists():
        return BUILT
    found = shutil.which("toxiproxy-server")
    return Path(found) if found else None


class FaultProxyError(RuntimeError):
    pass


class FaultProxy:
    """A Toxiproxy server on ``host`` of ``network`` (made already): ``start``, ``proxy`` a service, add toxics."""

    def __init__(self, network: Network, host: str, binary: Path | None = None) -> None:
        self.network, self.host = network, host
        self.binary = binary or toxiproxy_binary()
        if self.binary is None:
            raise FaultProxyError("toxiproxy-server not found: run scripts/install_fault_tools.sh")
        self.api = f"http://{network.address(host)}:{free_port()}"
        self._proc: subprocess.Popen | None = None

    def start(self, log: Path) -> FaultProxy:
        address, port = self.api.removeprefix("http://").rsplit(":", 1)
        on_host = ("ip", "netns", "exec", self.network.netns(self.host))
        with open(log, "ab") as out:  # gone with this process, however it ends (exec_child)
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    str(EXEC_CHILD),
                    str(os.getpid()),
                    *on_host,
                    str(self.binary),
                    "-host",
                    address,
                    "-port",
                    port,
                ],  # fmt: skip
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_ready(log)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, log: Path) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self._call("GET", "/proxies")
                return
            except OSError:
                if self._proc is None or self._proc.poll() is not None:
                    raise FaultProxyError(f"toxiproxy-server exited; see {log}") from None
                time.sleep(0.05)
        raise FaultProxyError(f"toxiproxy-server did not answer within {_START_TIMEOUT_S:g} s; see {log}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)
        self._proc = None

    def proxy(self, name: str, upstream: str) -> str:
        """Proxy ``upstream`` (host:port) from a free port on this host; returns the proxy's address."""
        listen = f"{self.network.address(self.host)}:{free_port()}"
        self._call("POST", "/proxies", {"name": name, "listen": listen, "upstream": upstream, "enabled": True})
        return listen

    def add_toxic(self, proxy: str, kind: str, stream: str = "downstream", **attributes: int) -> str:
        """Add a toxic (``latency=`` ms, ``reset_peer`` with ``timeout=`` ms, ...) to one direction of
        ``proxy`` (downstream: towards the client); returns its name."""
        name = f"{kind}_{stream}"
        body = {"name": name, "type": kind, "stream": stream, "toxicity": 1.0, "attributes": attributes}
        self._call("POST", f"/proxies/{proxy}/toxics", body)
        return name

    def remove_toxic(self, proxy: str, name: str) -> None:
        self._call("DELETE", f"/proxies/{proxy}/toxics/{name}")

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.api + path, data, {"Content-Type": "application/json"}, method=method)
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                text = reply.read()
        except urllib.error.HTTPError as e:
            raise FaultProxyError(f"toxiproxy {method} {path}: {e.code} {e.read().decode(errors='replace')}") from None
        return json.loads(text) if text.strip() else None

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
