"""The launcher as a process: signals stop the mesh cleanly; a dead launcher or a crashed child leaves no orphans."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.launcher.cli import add_up_parser
from kvmesh.launcher.compose import REPO_ROOT
from kvmesh.launcher.netns import can_make_hosts
from tests.launcher.helpers import alive, kill_if_alive, read_pid, wait_gone

pytestmark = pytest.mark.processes


@pytest.fixture
def launch(tmp_path) -> Iterator:
    started: list[subprocess.Popen] = []
    children: list[int] = []

    def start(start_delay_s: float = 0.0, *extra: str) -> tuple[subprocess.Popen, dict[str, int]]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.launcher.run_mesh", str(tmp_path), str(start_delay_s), *extra],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        pids = {name: read_pid(tmp_path / f"{name}.pid") for name in ("router", "gateway")}
        children.extend(pids.values())
        return proc, pids

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    kill_if_alive(children)


def _wait_for_line(proc: subprocess.Popen, text: str, stream: str = "stdout") -> str:
    for line in getattr(proc, stream):
        if text in line:
            return line
    raise AssertionError(f"launcher ended without printing {text!r}; stderr: {proc.stderr.read()}")


def test_sigterm_stops_the_mesh_and_exits_0(launch) -> None:
    proc, pids = launch()
    _wait_for_line(proc, "the test mesh is up")

    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)

    assert proc.returncode == 0, err
    assert "kvmesh: stopping the mesh" in err and "kvmesh: stopped" in err
    assert wait_gone(list(pids.values())) == []


def test_ctrl_c_during_start_up_stops_what_started(launch) -> None:
    proc, pids = launch(start_delay_s=600)

    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)

    assert proc.returncode == 0, err
    assert "stopped during start-up" in err
    assert wait_gone(list(pids.values())) == []


def test_a_killed_launcher_takes_the_mesh_with_it(launch) -> None:
    proc, pids = launch()
    _wait_for_line(proc, "the test mesh is up")

    proc.kill()  # SIGKILL: no chance to clean up; the children's parent-death signal does it
    proc.wait()

    assert wait_gone(list(pids.values())) == []


def test_a_crashed_child_is_reported_while_the_rest_keep_serving(launch) -> None:
    proc, pids = launch()
    _wait_for_line(proc, "the test mesh is up")

    os.kill(pids["router"], signal.SIGKILL)
    line = _wait_for_line(proc, "exited unexpectedly", "stderr")
    assert "router exited unexpectedly (code -9); the rest keep serving" in line
    assert alive(pids["gateway"])

    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1  # something crashed along the way
    assert wait_gone([pids["gateway"]]) == []


def test_a_supervising_launcher_restarts_a_crashed_child(launch, tmp_path) -> None:
    proc, pids = launch(0.0, "restart")
    _wait_for_line(proc, "the test mesh is up")

    os.kill(pids["router"], signal.SIGKILL)
    assert "router exited unexpectedly (code -9); restarting it in 0.2 s" in _wait_for_line(
        proc, "exited unexpectedly", "stderr"
    )
    _wait_for_line(proc, "router is serving again (restart 1)", "stderr")
    restarted = read_pid(tmp_path / "router.pid")
    assert restarted != pids["router"] and alive(restarted)

    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1  # it did crash along the way
    assert wait_gone([restarted, pids["gateway"]]) == []


def _up(*args: str) -> subprocess.CompletedProcess:
    """``kvmesh up ARGS`` (without installing anything first), as a process."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from kvmesh.launcher.cli import add_up_parser, run_up; import argparse;"
            "p = argparse.ArgumentParser(); add_up_parser(p.add_subparsers());"
            "sys.exit(run_up(p.parse_args(sys.argv[1:])))",
            "up",
            *args,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_up_refuses_a_missing_model_folder(tmp_path: Path) -> None:
    result = _up("--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert f"--model {tmp_path / 'nope'}: no model found; looked at the folder {tmp_path / 'nope'}: no such folder" in (
        result.stderr
    )


def test_up_refuses_a_hub_id_missing_from_the_hf_cache_naming_where_it_looked(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "up", "--model", "acme/absent", "--revision", "v1"],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"the Hugging Face cache {tmp_path / 'hub'} (from $HF_HUB_CACHE): no models--acme--absent" in result.stderr
    assert "huggingface-cli download acme/absent --revision v1" in result.stderr


@pytest.mark.skipif(bool(can_make_hosts()), reason=can_make_hosts() or "")
def test_up_refuses_a_hosts_file_that_leaves_a_process_out_before_starting_anything(tmp_path: Path) -> None:
    (tmp_path / "hosts.yml").write_text("hosts:\n  one: [redis, router, gateway, kvstore, speculator, prefill-0]\n")
    result = _up("--model", str(tmp_path), "--hosts", str(tmp_path / "hosts.yml"))
    assert result.returncode == 2
    assert "decode-0 is on none of the hosts" in result.stderr


def test_up_takes_replica_counts_and_a_restart_policy() -> None:
    parser = argparse.ArgumentParser()
    add_up_parser(parser.add_subparsers())
    args = parser.parse_args(["up", "--decode-replicas", "2", "--prefill-replicas", "3", "--max-restarts", "7"])
    assert (args.decode, args.prefill, args.max_restarts, args.restart) == (2, 3, 7, True)
    assert parser.parse_args(["up", "--decode", "4", "--no-restart"]).decode == 4  # the short spelling stays
    assert parser.parse_args(["up", "--no-restart"]).restart is False
