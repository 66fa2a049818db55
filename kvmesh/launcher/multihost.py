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
    """A ``Mesh`` and the network of hosts it runs on: ``start`` makes the network, then starts the mesh;
    ``stop`` stops the mesh, then removes the network (also when start failed half-way)."""

    def __init__(self, network: Network, mesh: Mesh) -> None:
        self.network = network
        self.mesh = mesh

    @classmethod
    def plan(cls, options: MeshOptions, run_dir: Path, hosts: HostsFile | None = None, **mesh_args: Any) -> HostedMesh:
        network, topology = plan_on_hosts(options, run_dir, hosts)
        return cls(network, Mesh(topology, run_dir, **mesh_args))

    def host_of(self, process: str) -> str:
        return self.network.hosts_file.host_of(process)

    def start(self) -> HostedMesh:
        self.network.create()
        try:
            self.mesh.start()
        except BaseException:
            self.network.remove()
            raise
        return self

    def stop(self) -> None:
        try:
            self.mesh.stop()
        finally:
            self.network.remove()

    def __enter__(self) -> HostedMesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
