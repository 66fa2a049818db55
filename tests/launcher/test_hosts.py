"""Placing a mesh's processes on hosts (pure): the hosts file, and the plan with every service at its host's address."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvmesh.launcher import ComposeError, MeshOptions, build_topology
from kvmesh.launcher.compose import REPO_ROOT
from kvmesh.launcher.hosts import HostsFile, Place

ADDRESS = re.compile(r"\b(\d+\.\d+\.\d+\.\d+):(\d+)")


def _options(**kw) -> MeshOptions:
    return MeshOptions(**({"model": Path("/models/tiny"), "compose_vars": {}, "prefill": 2, "decode": 2} | kw))


def _names() -> list[str]:
    return [p.name for p in build_topology(_options(), Path("/tmp/run")).processes]


def _placement(hosts: HostsFile) -> dict[str, Place]:
    addresses = {h: f"10.9.0.{i + 2}" for i, h in enumerate(hosts.hosts)}
    return {p: Place(h, f"ns-{h}", addresses[h]) for h, ps in hosts.hosts.items() for p in ps}


def test_the_repositorys_hosts_file_places_every_process_of_a_two_by_two_mesh() -> None:
    hosts = HostsFile.load(REPO_ROOT / "compose" / "hosts.yml").used_by(_names())
    assert sorted(p for ps in hosts.hosts.values() for p in ps) == sorted(_names())
    assert hosts.host_of("decode-1") == "decode-1" and hosts.host_of("speculator") == "kvstore"
    # A smaller mesh leaves the hosts it does not use out.
    assert "decode-1" not in HostsFile.load(REPO_ROOT / "compose" / "hosts.yml").used_by(["redis", "decode-0"]).hosts


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("hosts: []", "expected `hosts:`"),
        ("hosts:\n  a: router", "expected a list of process names"),
        ("hosts:\n  a: [router]\n  b: [router]", "router is on two hosts"),
    ],
)
def test_a_broken_hosts_file_is_refused_naming_the_problem(tmp_path, text, error) -> None:
    (tmp_path / "hosts.yml").write_text(text)
    with pytest.raises(ComposeError, match=error):
        HostsFile.load(tmp_path / "hosts.yml")


def test_a_process_on_no_host_is_refused() -> None:
    with pytest.raises(ComposeError, match="decode-1 is on none of the hosts"):
        HostsFile.one_host(["redis", "decode-0"]).used_by(["redis", "decode-0", "decode-1"])
    with pytest.raises(ComposeError, match="process router is on none of the hosts"):
        build_topology(_options(placement={"redis": Place("h", "ns", "10.9.0.2")}), Path("/tmp/run"))


def test_each_service_binds_to_its_hosts_address_and_is_reached_there() -> None:
    placement = _placement(HostsFile.each_alone(_names()))
    topo = build_topology(_options(placement=placement), Path("/tmp/run"))
    address_of = {p.name: p.address for p in topo.processes}
    for p in topo.processes:
        place = placement[p.name]
        assert (p.host, p.netns) == (place.address, place.netns)
        if p.role == "redis":
            assert p.argv[p.argv.index("--bind") + 1] == place.address
            continue
        assert p.env["KVMESH_HOST"] == place.address
        # Every address it is given is another process's, at that process's host.
        for value in p.env.values():
            for host, port in ADDRESS.findall(value):
                assert f"{host}:{port}" in address_of.values(), (p.name, value)
    assert topo.get("decode-1").env["KVMESH_ROUTER_ADDRESS"] == address_of["router"]
    assert topo.get("router").env["KVMESH_REDIS_URL"] == f"redis://{address_of['redis']}/0"
