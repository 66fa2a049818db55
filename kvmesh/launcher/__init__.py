"""``kvmesh up``: the whole mesh on one machine, each service its own process.

``build_topology(MeshOptions(...), run_dir)`` plans the processes from
``compose/docker-compose.yml`` (commands, ``KVMESH_*`` environment, ports,
devices, start order), ``MeshOptions`` overriding what the compose file says;
``Mesh(topology)`` runs them (start in dependency order until healthy, stop in
reverse, no orphans; with a ``RestartPolicy``, crashed processes are restarted
with backoff until they crash-loop).
"""

from kvmesh.launcher.compose import COMPOSE_FILE, ComposeError
from kvmesh.launcher.restart import RestartPolicy
from kvmesh.launcher.spec import MeshOptions, ProcessSpec, Topology
from kvmesh.launcher.supervisor import Mesh, MeshError, RunningProcess, StartInterrupted
from kvmesh.launcher.topology import build_topology
from kvmesh.runtime.ports import free_port

__all__ = [
    "COMPOSE_FILE",
    "ComposeError",
    "Mesh",
    "MeshError",
    "MeshOptions",
    "ProcessSpec",
    "RestartPolicy",
    "RunningProcess",
    "StartInterrupted",
    "Topology",
    "build_topology",
    "free_port",
]
