"""Hosts on one machine: a network namespace per host, each with its own address on a private bridge.

Each host gets a veth pair: one end (``eth0`` inside the namespace) carries the host's address, the
other is a port of the bridge in the launcher's namespace, which holds the subnet's first address, so
the launcher (its health checks, a test's client) reaches every host as a machine on the same network
would. What a real network does to a host is done to its bridge port:

- ``cut(host)`` / ``heal(host)``: the port down / up — the host drops off the network without any of
  its processes noticing (a partition, not a crash);
- ``cut_between(a, b)``: only a and b stop reaching each other (each routes the other's address to an
  address nobody holds, so packets vanish silently, as on a broken path);
- ``shape(host, bits_per_s)``: a token bucket (``tc tbf``) on both ends, a NIC of that speed;
- ``bytes_through(host)``: what crossed the host's link, both ways (to check that traffic left the host).

Linux only, as root (``ip netns``, ``ip link``, ``tc``). ``remove()`` deletes every namespace, link
and the bridge; ``Network`` is a context manager so a failing test still cleans up.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import subprocess
from collections.abc import Mapping
from pathlib import Path

from kvmesh.launcher.hosts import HostsFile, Place

# A /24 in 10.213.0.0/16 no route of this machine already covers (chosen per network).
_POOL = ipaddress.ip_network("10.213.0.0/16")
# Kernel tick: a token bucket's burst must hold at least rate / HZ bytes (HZ 250 at most here).
_TBF_TICKS_PER_S = 250
_TBF_MIN_BURST = 64 * 1024


class NetworkError(RuntimeError):
    pass


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def can_make_hosts() -> str | None:
    """None when this process can make namespaces here, else why not (tests skip with it)."""
    if not os.path.exists("/proc/self/ns/net") or os.geteuid() != 0:
        return "making hosts needs Linux network namespaces and root"
    try:
        _run("ip", "netns", "list")
    except (NetworkError, FileNotFoundError) as e:
        return f"ip netns does not work here: {e}"
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    taken = [
        ipaddress.ip_network(line.split()[0], strict=False)
        for line in _run("ip", "-4", "route", "show", "table", "all").splitlines()
        if line.split() and line.split()[0][0].isdigit()
    ]
    subnets = list(_POOL.subnets(new_prefix=24))
    start = secrets.randbelow(len(subnets))
    for subnet in subnets[start:] + subnets[:start]:
        if not any(subnet.overlaps(t) for t in taken if t.prefixlen > 0):
            return subnet
    raise NetworkError(f"no free /24 left in {_POOL}")


class Network:
    """The hosts of ``hosts_file`` as network namespaces on a bridge (made by ``create``)."""

    def __init__(self, hosts_file: HostsFile, subnet: ipaddress.IPv4Network | None = None) -> None:
        self.hosts_file = hosts_file
        self.tag = secrets.token_hex(3)  # names of this network's links and namespaces (15-character limit)
        self.subnet = subnet or _free_subnet()
        if self.subnet.num_addresses < len(self.hosts) + 4:
            raise NetworkError(f"{self.subnet} is too small for {len(self.hosts)} hosts")
        self.bridge = f"kvb{self.tag}"
        # The bridge (the launcher) holds the first address, the hosts the next ones in order, and the
        # one after them is nobody's (cut_between routes through it).
        first = self.subnet.network_address
        self._addresses = {h: str(first + 2 + i) for i, h in enumerate(self.hosts)}
        self._unused = str(first + 2 + len(self.hosts))
        self._made: list[str] = []  # namespaces made so far

    # -- names -------------------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        return list(self.hosts_file.hosts)

    def netns(self, host: str) -> str:
        return f"kvmesh-{self.tag}-{self.hosts.index(host)}"

    def _port(self, host: str) -> str:
        """The host's end of its link, on the bridge (in the launcher's namespace)."""
        return f"kvp{self.tag}{self.hosts.index(host)}"

    def address(self, host: str) -> str:
        return self._addresses[host]

    @property
    def launcher_address(self) -> str:
        """The launcher's own address on the bridge."""
        return str(self.subnet.network_address + 1)

    def placement(self) -> Mapping[str, Place]:
        """Process name -> where it runs (``MeshOptions.placement``)."""
        return {
            p: Place(host, self.netns(host), self.address(host))
            for host, processes in self.hosts_file.hosts.items()
            for p in processes
        }

    # -- life cycle --------------------------------------------------------------

    def create(self) -> Network:
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.launcher_address}/{self.subnet.prefixlen}", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for host in self.hosts:
                self._add_host(host, self._addresses[host])
        except BaseException:
            self.remove()
            raise
        return self

    def _add_host(self, host: str, address: str) -> None:
        ns, port = self.netns(host), self._port(host)
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", port, "master", self.bridge, "up")
        _run("ip", "-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def remove(self) -> None:
        """Delete every link, namespace and the bridge; safe to call twice."""
        for i, ns in enumerate(self._made):
            # A veth goes with its namespace, but only once the kernel gets to it: delete it now.
            subprocess.run(["ip", "link", "del", self._port(self.hosts[i])], capture_output=True, check=False)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._made.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    def __enter__(self) -> Network:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- what the network does to a host ---------------------------------------------

    def cut(self, host: str) -> None:
        _run("ip", "link", "set", self._port(host), "down")

    def heal(self, host: str) -> None:
        _run("ip", "link", "set", self._port(host), "up")

    def cut_between(self, a: str, b: str) -> None:
        for here, there in ((a, b), (b, a)):
            _run("ip", "-n", self.netns(here), "route", "add", f"{self.address(there)}/32", "via", self._unused)
            _run("ip", "-n", self.netns(here), "neigh", "flush", "all")

    def heal_between(self, a: str, b: str) -> None:
        for here, there in ((a, b), (b, a)):
            _run("ip", "-n", self.netns(here), "route", "del", f"{self.address(there)}/32")

    def shape(self, host: str, bits_per_s: float | None) -> None:
        """Cap the host's link at ``bits_per_s`` each way (None: no cap)."""
        ends = (("ip", "netns", "exec", self.netns(host), "tc"), "eth0"), (("tc",), self._port(host))
        for tc, dev in ends:
            if bits_per_s is None:
                subprocess.run([*tc, "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False)
                continue
            burst = max(int(bits_per_s / 8 / _TBF_TICKS_PER_S), _TBF_MIN_BURST)
            _run(*tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(bits_per_s)}bit",
                 "burst", str(burst), "latency", "50ms")  # fmt: skip

    def bytes_through(self, host: str) -> int:
        """Bytes the host's link carried so far, both directions."""
        stats = Path("/sys/class/net") / self._port(host) / "statistics"
        return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())
