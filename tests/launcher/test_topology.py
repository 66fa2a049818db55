"""Planning a mesh (pure): processes, start levels, ports, environment, devices."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvmesh.launcher import MeshOptions, build_topology
from kvmesh.launcher.topology import REPO_ROOT, describe

MODEL = Path("/models/tiny")
RUN = Path("/tmp/run")


def _ports(start: int = 40000):
    counter = itertools.count(start)
    return lambda: next(counter)


def test_the_default_mesh() -> None:
    topo = build_topology(MeshOptions(model=MODEL, python="py"), RUN, _ports())

    assert [p.name for p in topo.processes] == ["redis", "router", "kvstore", "speculator", "prefill-0", "decode-0", "gateway"]
    assert [[p.name for p in level] for level in topo.levels()] == [
        ["redis"], ["router"], ["kvstore", "speculator"], ["prefill-0", "decode-0"], ["gateway"]
    ]
    gateway = topo.get("gateway")
    assert gateway.address == "127.0.0.1:50051"
    assert gateway.argv == ("py", "-m", "services.gateway.main") and gateway.workdir == REPO_ROOT
    assert gateway.env["KVMESH_ROUTER_ADDRESS"] == topo.get("router").address
    assert gateway.env["KVMESH_MODEL"] == str(MODEL) and "KVMESH_MODEL_NAME" not in gateway.env
    assert gateway.env["KVMESH_PORT"] == "50051"


def test_services_are_wired_to_each_other() -> None:
    topo = build_topology(MeshOptions(model=MODEL), RUN, _ports())
    redis, router, kvstore, spec = (topo.get(n) for n in ("redis", "router", "kvstore", "speculator"))

    assert redis.argv[1:] == ("--port", str(redis.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", ".")
    assert redis.workdir == RUN / "redis" and redis.health == "redis"
    assert router.env["KVMESH_REDIS_URL"] == f"redis://127.0.0.1:{redis.port}/0"
    assert kvstore.env["KVMESH_ROUTER_ADDRESS"] == router.address
    for name in ("prefill-0", "decode-0"):
        env = topo.get(name).env
        assert env["KVMESH_WORKER_ID"] == name and env["KVMESH_DEVICE"] == "cpu"
        assert env["KVMESH_ROUTER_ADDRESS"] == router.address and env["KVMESH_KVSTORE_ADDRESS"] == kvstore.address
        assert env["KVMESH_MODEL"] == str(MODEL)
    assert topo.get("decode-0").env["KVMESH_SPECULATOR_ADDRESS"] == spec.address
    assert "KVMESH_SPECULATOR_ADDRESS" not in topo.get("prefill-0").env
    for p in topo.processes[1:]:
        assert p.env["KVMESH_PORT"] == str(p.port) and p.env["KVMESH_METRICS_PORT"] == str(p.metrics_port)
        assert p.env["KVMESH_HOST"] == "127.0.0.1" and p.env["KVMESH_GRACE_SECONDS"] == "5"


def test_no_speculator() -> None:
    topo = build_topology(MeshOptions(model=MODEL, speculator=False), RUN, _ports())

    assert "speculator" not in [p.name for p in topo.processes]
    assert "KVMESH_SPECULATOR_ADDRESS" not in topo.get("decode-0").env


def test_several_workers_share_out_the_devices() -> None:
    options = MeshOptions(model=MODEL, prefill=2, decode=3, device_prefill="cuda:0", device_decode="cuda:1, cuda:2")
    topo = build_topology(options, RUN, _ports())

    assert [(p.name, p.device) for p in topo.processes if p.device] == [
        ("prefill-0", "cuda:0"), ("prefill-1", "cuda:0"),
        ("decode-0", "cuda:1"), ("decode-1", "cuda:2"), ("decode-2", "cuda:1"),
    ]


def test_base_port_numbers_everything_but_the_gateway_consecutively() -> None:
    topo = build_topology(MeshOptions(model=MODEL, base_port=60000, gateway_port=7000), RUN)

    ports = [port for p in topo.processes for port in (p.port, p.metrics_port) if port is not None]
    assert topo.get("redis").port == 60000 and topo.get("router").port == 60001
    assert topo.get("gateway").port == 7000
    assert sorted(set(ports) - {7000}) == list(range(60000, 60000 + len(ports) - 1))


def test_free_ports_are_never_handed_out_twice() -> None:
    repeating = itertools.cycle([41000, 41000, 41001, 41002, 41003, 41004, 41005, 41006, 41007, 41008, 41009,
                                 41010, 41011, 41012, 41013])
    topo = build_topology(MeshOptions(model=MODEL, gateway_port=0), RUN, lambda: next(repeating))

    ports = [port for p in topo.processes for port in (p.port, p.metrics_port) if port is not None]
    assert len(ports) == len(set(ports))


def test_clashing_ports_are_refused() -> None:
    with pytest.raises(ValueError, match="port 60001 is given to both"):
        build_topology(MeshOptions(model=MODEL, base_port=60000, gateway_port=60001), RUN)


def test_extra_settings_per_role_and_a_model_name() -> None:
    options = MeshOptions(model=MODEL, model_name="demo", role_env={"decode": {"KVMESH_NUM_BLOCKS": "64"}})
    topo = build_topology(options, RUN, _ports())

    assert topo.get("decode-0").env["KVMESH_NUM_BLOCKS"] == "64"
    assert "KVMESH_NUM_BLOCKS" not in topo.get("prefill-0").env
    assert topo.get("gateway").env["KVMESH_MODEL_NAME"] == "demo"


@pytest.mark.parametrize("counts", [{"decode": 0}, {"prefill": -1}])
def test_impossible_counts_are_refused(counts) -> None:
    with pytest.raises(ValueError, match="at least one decode worker"):
        MeshOptions(model=MODEL, **counts)


def test_describe_lists_every_endpoint() -> None:
    topo = build_topology(MeshOptions(model=MODEL), RUN, _ports())
    lines = describe(topo, RUN)

    assert len(lines) == len(topo.processes)
    assert "gateway" in lines[-1] and "gRPC 127.0.0.1:50051" in lines[-1] and str(RUN / "logs" / "gateway.log") in lines[-1]
    assert "redis://127.0.0.1:" in lines[0]
