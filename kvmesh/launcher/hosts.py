"""Which host each process of a mesh runs on: the hosts file (``kvmesh up --hosts``), and a process's place.

A hosts file names hosts and the processes on each (process names as ``kvmesh up`` gives them:
``router``, ``prefill-0``, ``decode-1``)::

    hosts:
      redis: [redis]
      router: [router]
      decode-0: [decode-0]
      ...

Locally each host is a network namespace with its own address on a bridge (``kvmesh.launcher.netns``);
the launcher's own namespace reaches every host over that bridge, as a client on the same network would.
Pure: reading the file and checking it against a mesh's process names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvmesh.launcher.compose import ComposeError


@dataclass(frozen=True)
class Place:
    """Where one process runs: the host's name, its network namespace and its address there."""

    host: str
    netns: str
    address: str


@dataclass(frozen=True)
class HostsFile:
    # host name -> the processes it runs, in the file's order
    hosts: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        owners: dict[str, str] = {}
        for host, processes in self.hosts.items():
            for p in processes:
                if p in owners:
                    raise ComposeError(f"process {p} is on two hosts: {owners[p]} and {host}")
                owners[p] = host

    @classmethod
    def load(cls, path: Path) -> HostsFile:
        doc = yaml.safe_load(path.read_text()) or {}
        hosts = doc.get("hosts") if isinstance(doc, dict) else None
        if not isinstance(hosts, dict) or not hosts:
            raise ComposeError(f"{path}: expected `hosts:` mapping each host to a list of process names")
        for host, processes in hosts.items():
            if not isinstance(processes, list) or not all(isinstance(p, str) for p in processes):
                raise ComposeError(f"{path}: host {host}: expected a list of process names, got {processes!r}")
        return cls({str(h): tuple(ps) for h, ps in hosts.items()})

    @classmethod
    def one_host(cls, processes: Iterable[str], name: str = "host") -> HostsFile:
        """Every process on the same host (the colocated baseline of a multi-host run)."""
        return cls({name: tuple(processes)})

    @classmethod
    def each_alone(cls, processes: Iterable[str]) -> HostsFile:
        """Every process on a host of its own, named after it."""
        return cls({p: (p,) for p in processes})

    def host_of(self, process: str) -> str:
        for host, processes in self.hosts.items():
            if process in processes:
                return host
        raise ComposeError(f"process {process} is on none of the hosts ({', '.join(self.hosts)})")

    def used_by(self, processes: Iterable[str]) -> HostsFile:
        """Only the hosts that run one of ``processes``, each with only those (every one of them placed)."""
        wanted = list(processes)
        for p in wanted:
            self.host_of(p)
        kept = {h: tuple(p for p in ps if p in wanted) for h, ps in self.hosts.items()}
        return HostsFile({h: ps for h, ps in kept.items() if ps})
