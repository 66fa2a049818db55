"""A real ``redis-server`` for tests: a fresh one per test, on a free loopback port.

Tests that need Redis take the ``redis_server`` fixture; it skips them (with
the reason) where ``redis-server`` is not installed. The server keeps nothing
on disk, and a test may ``stop()`` and ``start()`` it again on the same port
to play an outage.

A test that fails because a mesh process died while starting gets that
process's last log lines in its report: the message alone says only the exit
code, and a failure seen once in CI must be diagnosable from its report.

The suite runs on pytest-xdist runners (``make test``: ``-n 2 --dist loadgroup``). Each runner
picks ports from its own slice of the range; which runner runs which tests: tests/xdist_groups.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch

from kvmesh.launcher.supervisor import MeshError
from kvmesh.runtime.ports import PORT_RANGE_ENV, free_port, port_slice

pytest_plugins = ["tests.durations", "tests.xdist_groups"]

# Folders whose tests run whole meshes, containers or the clients' toolchains as processes: marked
# ``processes``, which `make test-fast` leaves out (a file elsewhere that starts processes says so itself).
PROCESS_FOLDERS = ("tests/e2e/", "tests/openai/", "tests/clients/", "tests/compose/", "tests/deploy/")


def pytest_configure(config: pytest.Config) -> None:
    runner = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... on xdist's runners
    if runner is not None:
        os.environ[PORT_RANGE_ENV] = port_slice(int(runner[2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    # Workers these tests start (meshes, containers) decode eagerly, as compiling every mesh's graphs would
    # cost minutes each; the compiled path has tests of its own, which compile into this run's own cache.
    os.environ["KVMESH_COMPILE"] = os.environ["KVMESH_DECODE_COMPILE"] = "0"  # the flag; the compose files' variable
    os.environ["KVMESH_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="kvmesh-compile-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ.pop("KVMESH_COMPILE_CACHE", ""), ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # kvmesh's native CPU kernels (kernels/cpu) need AVX-512, as kernels.cpu checks it: without them the
    # paths that only exist on them (--deterministic on CPU, int8 weights on CPU, streamed rows) are refused.
    capability = torch.backends.cpu.get_cpu_capability()
    no_native = pytest.mark.skip(reason=f"needs kvmesh's native CPU kernels (AVX-512); this CPU reports {capability}")
    for item in items:
        if item.nodeid.startswith(PROCESS_FOLDERS):
            item.add_marker(pytest.mark.processes)
        if capability != "AVX512" and item.get_closest_marker("native_cpu") is not None:
            item.add_marker(no_native)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, MeshError):
        report.sections.append((f"log of {call.excinfo.value.process}", call.excinfo.value.log_tail))
    return report


class RedisServer:
    def __init__(self, exe: str, port: int, workdir: str) -> None:
        self.exe = exe
        self.port = port
        self.workdir = workdir
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.workdir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not on PATH (Debian: apt-get install redis-server)")
    server = RedisServer(exe, free_port(), str(tmp_path))
    server.start()
    try:
        yield server
    finally:
        server.stop()
