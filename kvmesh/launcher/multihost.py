"""A mesh spread over hosts: the network of hosts (``netns.Network``) and the mesh placed on it, as one.

The launcher lays out the mesh as usual (``build_topology``), learns its process names, places each on
its host from a hosts file (default: every process alone on a host), and builds the plan again with
those places: every service binds to its host's address and is reached (and advertised) there. KV
between hosts moves as between machines: NIXL's UCX is held to TCP (``UCX_TLS=tcp,self``; namespaces
share /dev/shm, so UCX would otherwise take shared memory between "hosts") unless a role's settings
choose otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvmesh.launcher.faultproxy import FaultProxy
from kvmesh.launcher.hosts import HostsFile
from kvmesh.launcher.netns import Network
from kvmesh.launcher.spec import MeshOptions, Topology
from kvmesh.launcher.supervisor import Mesh
from kvmesh.launcher.topology import build_topology

# The roles whose KV crosses hosts over NIXL, and the UCX transports a real cross-host link has.
KV_ROLES = ("prefill", "decode", "kvstore")
TCP_ONLY_UCX = {"UCX_TLS": "tcp,self"}


def plan_on_hosts(options: MeshOptions, run_dir: Path, hosts: HostsFile | None = None) -> tuple[Network, Topology]:
    """The network of the hosts ``options``' processes run on (not made yet) and the mesh placed on it."""
    names = [p.name for p in build_topology(options, run_dir).processes]
    hosts = (hosts or HostsFile.each_alone(names)).used_by(names)
    network = Network(hosts)
    role_env: dict[str, Mapping[str, str]] = dict(options.role_env)
    if len(hosts.hosts) > 1:
        for role in KV_ROLES:
            role_env[role] = {**TCP_ONLY_UCX, **role_env.get(role, {})}
    placed = replace(options, placement=network.placement(), role_env=role_env)
    return network, build_topology(placed, run_dir)


class HostedMesh:
    """A mesh and the network of hosts it runs on: ``start`` makes the network, then starts the mesh;
    ``stop`` stops the mesh, then removes the network (also when start failed half-way). ``behind_proxy``
    (before ``start``) puts a process behind a Toxiproxy on its host, for faults on its link."""

    def __init__(self, network: Network, topology: Topology, run_dir: Path, **mesh_args: Any) -> None:
        self.network, self.run_dir = network, run_dir
        self.mesh = Mesh(topology, run_dir, **mesh_args)
        self.proxies: list[FaultProxy] = []
        self._network_up = False

    @classmethod
    def plan(cls, options: MeshOptions, run_dir: Path, hosts: HostsFile | None = None, **mesh_args: Any) -> HostedMesh:
        network, topology = plan_on_hosts(options, run_dir, hosts)
        return cls(network, topology, run_dir, **mesh_args)

    def host_of(self, process: str) -> str:
        return self.network.hosts_file.host_of(process)

    def _up(self) -> None:
        if not self._network_up:
            self.network.create()
            self._network_up = True

    def behind_proxy(self, process: str) -> tuple[FaultProxy, str]:
        """A Toxiproxy on ``process``'s host in front of its gRPC port, which it advertises instead of its own;
        returns the proxy and the proxy's name for ``add_toxic``."""
        self._up()
        proxy = FaultProxy(self.network, self.host_of(process))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.proxies.append(proxy.start(self.run_dir / f"toxiproxy-{process}.log"))
        spec = self.mesh.topology.get(process)
        address = proxy.proxy(process, spec.address)
        placed = replace(spec, env={**spec.env, "KVMESH_ADVERTISE_ADDRESS": address})
        processes = tuple(placed if p.name == process else p for p in self.mesh.topology.processes)
        self.mesh.topology = replace(self.mesh.topology, processes=processes)
        return proxy, process

    def start(self) -> HostedMesh:
        self._up()
        try:
            self.mesh.start()
        except BaseException:
            self._down()
            raise
        return self

    def stop(self) -> None:
        try:
            self.mesh.stop()
        finally:
            self._down()

    def _down(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        self.proxies.clear()
        self.network.remove()
        self._network_up = False

    def __enter__(self) -> HostedMesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
