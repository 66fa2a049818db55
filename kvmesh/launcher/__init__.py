"""``kvmesh up``: the whole mesh on one machine, each service its own process.

``build_topology(MeshOptions(...), run_dir)`` plans the processes (commands,
``KVMESH_*`` environment, ports, devices); ``Mesh(topology)`` runs them
(start in dependency order until healthy, stop in reverse, no orphans).
"""

from kvmesh.launcher.supervisor import Mesh, MeshError, RunningProcess, StartInterrupted
from kvmesh.launcher.topology import MeshOptions, ProcessSpec, Topology, build_topology, free_port

__all__ = ["Mesh", "MeshError", "MeshOptions", "ProcessSpec", "RunningProcess", "StartInterrupted", "Topology", "build_topology", "free_port"]
