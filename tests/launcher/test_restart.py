"""Supervision: crashed processes restart with exponential backoff, crash loops stop; decisions and real processes."""

from __future__ import annotations

import re
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.launcher import Mesh, RestartPolicy, Topology
from kvmesh.launcher.restart import CrashRecord
from tests.launcher.helpers import alive, child, read_pid, wait_gone

pytestmark = [pytest.mark.timeout(120), pytest.mark.processes]


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=3.0, multiplier=2.0)
    assert [policy.backoff_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_crash_streak_gives_up_after_max_restarts_and_a_stable_run_starts_it_over() -> None:
    policy = RestartPolicy(initial_backoff_s=1.0, max_restarts=2, stable_after_s=10.0)
    record = CrashRecord(started_at=0.0)
    assert record.crashed(policy, now=1.0) == 1.0
    record.restarted(now=2.0)
    assert record.crashed(policy, now=3.0) == 2.0  # crashed again before it was stable
    record.restarted(now=5.0)
    assert record.crashed(policy, now=20.0) == 1.0  # ran 15 s: stable, so a fresh streak
    record.restarted(now=21.0)
    record.crashed(policy, now=22.0)
    record.restarted(now=24.0)
    assert record.crashed(policy, now=25.0) is None  # two restarts in a row, both crashed: a loop
    assert record.gave_up and record.total_restarts == 4


def _pid_changes(path, old: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = read_pid(path)
        if pid != old:
            return pid
        time.sleep(0.05)
    raise AssertionError(f"{path} still names pid {old}")


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _wait_for(events: list[str], pattern: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in list(events):
            if re.search(pattern, e):
                return e
        time.sleep(0.05)
    raise AssertionError(f"no event matching {pattern!r} in {events}")


def test_a_crashed_process_is_restarted_on_its_port_and_serves_again(tmp_path) -> None:
    events: list[str] = []
    worker = child("decode-0", "decode", pid_file=tmp_path / "decode.pid")
    policy = RestartPolicy(initial_backoff_s=0.2, max_restarts=3)
    mesh = Mesh(
        Topology((child("router", "router"), worker)), tmp_path / "run", on_progress=events.append, restart=policy
    )
    with mesh:
        first = read_pid(tmp_path / "decode.pid")
        assert mesh.crash("decode-0") == mesh.process("decode-0").pid
        second = _pid_changes(tmp_path / "decode.pid", first)
        _wait_for(events, r"decode-0 is serving again \(restart 1\)")

        assert not alive(first) and alive(second)
        assert _serving(worker.address)  # the same address: its peers find it where it was
        assert mesh.restarts("decode-0") == 1 and mesh.restarts("router") == 0
        assert mesh.crashed() == []
        assert any("decode-0 exited unexpectedly (code -9); restarting it in 0.2 s" in e for e in events)

        mesh.kill("decode-0", signal.SIGKILL)  # on purpose: not restarted
        time.sleep(0.5)
        assert mesh.restarts("decode-0") == 1 and mesh.process("decode-0").pid == second
    assert wait_gone([second]) == []


def test_a_crash_loop_backs_off_exponentially_then_gives_up_and_says_so(tmp_path) -> None:
    events: list[str] = []
    marker = tmp_path / "broken"
    worker = child("decode-0", "decode", pid_file=tmp_path / "decode.pid", fail_at_start_if_exists=marker)
    policy = RestartPolicy(initial_backoff_s=0.1, multiplier=2.0, max_restarts=3)
    with Mesh(Topology((worker,)), tmp_path / "run", on_progress=events.append, restart=policy) as mesh:
        marker.write_text("the model folder went away")  # every restart now fails at start-up
        mesh.crash("decode-0")

        line = _wait_for(events, r"decode-0 crashed 4 times in a row")
        assert "a crash loop; not restarting it again" in line
        assert "boom: the model folder is missing" in line  # its last log lines
        delays = [
            float(m.group(1)) for e in events if (m := re.search(r"decode-0 exited .* restarting it in ([\d.]+) s", e))
        ]
        assert delays == [0.1, 0.2, 0.4]
        assert mesh.restarts("decode-0") == 3
        assert mesh.crashed() == ["decode-0"]
        assert mesh.wait() == "decode-0"
        assert not any("serving again" in e for e in events)
