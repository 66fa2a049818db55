"""The supervisor with tiny real service processes: ordered start, health wait, clean failure, no orphans."""

from __future__ import annotations

import shutil
import signal
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.launcher import Mesh, MeshError, MeshOptions, ProcessSpec, Topology, build_topology
from tests.launcher.helpers import alive, child, kill_if_alive, read_pid, wait_gone

pytestmark = pytest.mark.processes


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_levels_start_in_order_and_stop_exits_everything_cleanly(tmp_path) -> None:
    router = child("router", "router")
    # Refuses to start unless the router is already SERVING: proves the level order.
    gateway = child("gateway", "gateway", require_serving=router.address)
    mesh = Mesh(Topology((gateway, router)), tmp_path)
    with mesh:
        assert _serving(router.address) and _serving(gateway.address)
        pids = [mesh.process("router").pid, mesh.process("gateway").pid]
        assert mesh.crashed() == []

    assert [mesh.process(n).popen.returncode for n in ("router", "gateway")] == [0, 0]  # SIGTERM -> drained, exit 0
    assert wait_gone(pids) == []
    assert '"event": "child ready"' in (tmp_path / "logs" / "gateway.log").read_text()
    assert (tmp_path / "topology.json").is_file()


def test_a_process_dying_at_start_up_stops_the_others_and_reports_its_log(tmp_path) -> None:
    router = child("router", "router", pid_file=tmp_path / "router.pid")
    slow = child("prefill-0", "prefill", start_delay_s=600, pid_file=tmp_path / "slow.pid")
    broken = child("decode-0", "decode", fail_at_start=True)
    mesh = Mesh(Topology((router, slow, broken)), tmp_path / "run")

    with pytest.raises(MeshError) as info:
        mesh.start()

    assert info.value.process == "decode-0"
    assert str(info.value) == "decode-0 exited with code 1 during start-up"
    assert "[decode-0] " in info.value.log_tail and "boom: the model folder is missing" in info.value.log_tail
    pids = [mesh.process(n).pid for n in ("router", "prefill-0", "decode-0")]
    assert all(mesh.process(n).popen.returncode is not None for n in ("router", "prefill-0", "decode-0"))
    assert wait_gone(pids) == []


def test_a_process_that_never_becomes_healthy_times_out(tmp_path) -> None:
    slow = child("router", "router", start_delay_s=600)
    mesh = Mesh(Topology((slow,)), tmp_path, start_timeout_s=1.0)

    with pytest.raises(MeshError, match="router not healthy within 1 s"):
        mesh.start()
    assert wait_gone([mesh.process("router").pid]) == []


def test_stop_kills_a_process_that_ignores_sigterm_and_everything_it_spawned(tmp_path) -> None:
    stubborn = child("router", "router", ignore_sigterm=True, grandchild_pid_file=tmp_path / "sleep.pid")
    mesh = Mesh(Topology((stubborn,)), tmp_path / "run", stop_timeout_s=1.0)
    pids = []
    try:
        mesh.start()
        pids = [mesh.process("router").pid, read_pid(tmp_path / "sleep.pid")]
        mesh.stop()
        assert mesh.process("router").popen.returncode == -signal.SIGKILL
        assert wait_gone(pids) == []
    finally:
        kill_if_alive(pids)


def test_kill_one_process_and_stop_the_rest(tmp_path) -> None:
    with Mesh(Topology((child("router", "router"), child("decode-0", "decode"))), tmp_path) as mesh:
        mesh.kill("decode-0", signal.SIGKILL)

        assert mesh.process("decode-0").popen.returncode == -signal.SIGKILL
        assert alive(mesh.process("router").pid)
        assert mesh.crashed() == []  # killed on purpose
    assert mesh.process("router").popen.returncode == 0


def test_a_process_that_dies_on_its_own_is_reported(tmp_path) -> None:
    with Mesh(Topology((child("router", "router"), child("decode-0", "decode"))), tmp_path) as mesh:
        mesh.process("decode-0").popen.send_signal(signal.SIGKILL)  # from outside, like the OOM killer

        assert mesh.wait() == "decode-0"
        assert mesh.crashed() == ["decode-0"]


def test_a_missing_binary_fails_start_up_clearly(tmp_path) -> None:
    missing = Topology(
        (ProcessSpec("redis", "redis", ("/nonexistent/redis-server",), {}, "127.0.0.1", 1, health="redis"),)
    )

    with pytest.raises(MeshError) as info:
        Mesh(missing, tmp_path).start()

    assert "exited with code 127" in str(info.value)
    assert "cannot run /nonexistent/redis-server" in info.value.log_tail


def test_the_topologys_redis_starts_and_answers(tmp_path) -> None:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not on PATH (Debian: apt-get install redis-server)")
    topology = build_topology(MeshOptions(model=tmp_path, redis_server=exe, gateway_port=0), tmp_path)
    redis = topology.get("redis")

    with Mesh(Topology((redis,), certs=topology.certs), tmp_path) as mesh:
        with socket.create_connection((redis.host, redis.port), timeout=5) as s:
            s.sendall(b"CONFIG GET save\r\n")
            assert s.recv(256).startswith(b"-NOAUTH")  # the mesh's Redis wants its password
            s.sendall(b"AUTH %s\r\n" % redis.redis_password_file.read_bytes().strip())
            assert s.recv(16) == b"+OK\r\n"
            s.sendall(b"CONFIG GET save\r\n")
            assert b"save" in s.recv(256)
        pid = mesh.process("redis").pid
    assert wait_gone([pid]) == []
    assert not list((tmp_path / "redis").glob("*.rdb"))  # nothing persisted
