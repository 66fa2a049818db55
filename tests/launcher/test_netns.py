"""Hosts as network namespaces (real, as root): each reaches the others, a cut or shaped link does what a
real one would, and removing the network leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmesh.launcher.hosts import HostsFile
from kvmesh.launcher.netns import Network, can_make_hosts

NO_HOSTS = can_make_hosts()
pytestmark = pytest.mark.skipif(bool(NO_HOSTS), reason=NO_HOSTS or "")

# Connects to ADDRESS:PORT within 1 s: prints "ok", or the error.
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
    print("ok")
except OSError as e:
    print(type(e).__name__)
"""
SERVE = "import socket, time; s = socket.create_server(('0.0.0.0', 7000)); time.sleep(60)"


def _on(network: Network, host: str, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", network.netns(host), *argv], stdout=subprocess.PIPE, text=True)


def _connects(network: Network, src: str, dst: str) -> str:
    proc = _on(network, src, sys.executable, "-c", CONNECT, network.address(dst), "7000")
    return proc.communicate(timeout=10)[0].strip()


@pytest.fixture
def network():
    with Network(HostsFile.each_alone(["a", "b", "c"])) as net:
        servers = [_on(net, h, sys.executable, "-c", SERVE) for h in net.hosts]
        try:
            for h in net.hosts:  # listening before the tests connect
                assert any(_connects(net, h, h) == "ok" for _ in range(50))
            yield net
        finally:
            for s in servers:
                s.kill()
                s.wait()


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_hosts_reach_each_other_until_cut_and_again_once_healed(network) -> None:
    assert _connects(network, "a", "b") == "ok" and _connects(network, "c", "b") == "ok"
    network.cut("b")
    assert _connects(network, "a", "b") == "TimeoutError"  # silence, not a refusal: the host is just gone
    assert _connects(network, "a", "c") == "ok"
    network.heal("b")
    assert _connects(network, "a", "b") == "ok"


def test_a_link_between_two_hosts_is_cut_without_touching_the_others(network) -> None:
    network.cut_between("a", "b")
    assert _connects(network, "a", "b") == "TimeoutError" and _connects(network, "b", "a") == "TimeoutError"
    assert _connects(network, "a", "c") == "ok" and _connects(network, "c", "b") == "ok"
    network.heal_between("a", "b")
    assert _connects(network, "a", "b") == "ok"


def test_a_shaped_link_has_a_token_bucket_on_both_ends_and_traffic_is_counted(network) -> None:
    before = network.bytes_through("a")
    assert _connects(network, "a", "b") == "ok"
    assert network.bytes_through("a") > before
    network.shape("a", 25e9)
    inside = subprocess.run(
        ["ip", "netns", "exec", network.netns("a"), "tc", "qdisc", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "tbf" in inside and "25Gbit" in inside
    network.shape("a", None)
    assert "tbf" not in subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=True).stdout


def test_removing_the_network_leaves_no_namespace_link_or_bridge() -> None:
    net = Network(HostsFile.each_alone(["a", "b"])).create()
    names = [net.netns(h) for h in net.hosts]
    assert set(names) <= set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    net.remove()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in left for n in names)
    assert net.tag not in _links()
