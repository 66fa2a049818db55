"""Run a ``Topology`` as real processes: start level by level until healthy, stop in reverse, leave nothing behind.

Each process gets its own process group (so signals reach anything it
spawned, and a terminal's Ctrl-C reaches only the launcher, which then stops
the mesh in order) and a parent-death signal (so killing the launcher, even
with SIGKILL, still stops the mesh). Output goes to ``<run_dir>/logs/<name>.log``.

    with Mesh(topology) as mesh:          # start() ... stop()
        mesh.kill("decode-0", signal.SIGKILL)

With a ``RestartPolicy`` the mesh supervises itself once started: a thread
watches every process, and one that exits without being stopped or killed
through this object is started again (same command, same ports, so its peers
find it where it was) after an exponential backoff, until it crash-loops
(``restart.py``); then it is left down and reported. A restarted worker
registers with the router again on its own; until then the router stops
routing to the dead one when its lease lapses (``--lease-ttl-ms``, 10 s by
default) or when the new one registers under the same worker id, whichever
comes first, and the gateway meanwhile retries or migrates what it sent there.

Call ``start`` from a thread that lives as long as the mesh (the main
thread): Linux delivers the parent-death signal when the spawning thread ends.
(The supervising thread, which spawns restarts, lives until ``stop``.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.launcher.restart import CrashRecord, RestartPolicy
from kvmesh.launcher.spec import ProcessSpec, Topology
from kvmesh.runtime.certs import ensure_mesh_certs, role_identity
from kvmesh.runtime.channel import create_blocking_channel
from kvmesh.runtime.tls import TlsFiles

EXEC_CHILD = Path(__file__).with_name("exec_child.py")
DEFAULT_STOP_TIMEOUT_S = 20.0
_POLL_S = 0.1


class MeshError(RuntimeError):
    """The mesh could not start (a process died or stayed unhealthy); carries that process's last log lines."""

    def __init__(self, message: str, process: str, log_tail: str) -> None:
        super().__init__(message)
        self.process = process
        self.log_tail = log_tail


class StartInterrupted(RuntimeError):
    """``interrupt`` was called while the mesh was starting; everything started is stopped again."""


@dataclass
class RunningProcess:
    spec: ProcessSpec
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid


class Mesh:
    def __init__(
        self,
        topology: Topology,
        run_dir: Path | None = None,
        *,
        start_timeout_s: float = 600.0,
        stop_timeout_s: float | None = None,
        on_progress: Callable[[str], None] | None = None,
        restart: RestartPolicy | None = None,
    ) -> None:
        self.topology = topology
        self.run_dir = run_dir if run_dir is not None else Path(tempfile.mkdtemp(prefix="kvmesh-run-"))
        self._start_timeout_s = start_timeout_s
        # None: each process's own stop_grace_s (the compose file's stop_grace_period), else 20 s.
        self._stop_timeout_s = stop_timeout_s
        self._progress = on_progress or (lambda _: None)
        self._procs: dict[str, RunningProcess] = {}
        self._ended_on_purpose: set[str] = set()  # killed or stopped by us: not a crash
        self._interrupted = threading.Event()
        self._hurry = threading.Event()
        self._restart = restart
        self._records: dict[str, CrashRecord] = {}
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- life cycle ----------------------------------------------------------

    def start(self) -> Mesh:
        """Start every level and wait until it is healthy; on any failure stop everything and raise."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.topology.certs is not None:
            ensure_mesh_certs(self.topology.certs)  # kept across restarts of the same run folder
        plan = [asdict(p) | {"level": p.level} for p in self.topology.processes]
        (self.run_dir / "topology.json").write_text(json.dumps(plan, indent=2, default=str))
        deadline = time.monotonic() + self._start_timeout_s
        try:
            for level in self.topology.levels():
                for spec in level:
                    self._spawn(spec)
                self._wait_healthy(level, deadline)
        except BaseException:
            self.stop()
            raise
        if self._restart is not None:
            now = time.monotonic()
            self._records = {name: CrashRecord(started_at=now) for name in self._procs}
            self._supervisor = threading.Thread(target=self._supervise, name="kvmesh-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def stop(self) -> None:
        """SIGTERM level by level, last started first; SIGKILL what outlives the stop timeout. Idempotent."""
        self._stopping.set()  # no restarts from here on
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join()
        for level in reversed(self.topology.levels()):
            procs = [self._procs[s.name] for s in level if s.name in self._procs]
            self._ended_on_purpose.update(p.spec.name for p in procs)
            for p in procs:
                if p.popen.poll() is None:
                    self._signal(p, signal.SIGKILL if self._hurry.is_set() else signal.SIGTERM)
            started = time.monotonic()
            for p in procs:
                limit = self._stop_limit(p.spec)
                if not self._wait(p, started + limit):
                    self._progress(f"{p.spec.name} did not stop within {limit:g} s: killing it")
                    self._signal(p, signal.SIGKILL)
                    p.popen.wait()
                self._signal(p, signal.SIGKILL)  # whatever it spawned and left behind in its group

    def interrupt(self) -> None:
        """What a signal handler calls: the first call ends ``start`` (StartInterrupted) or ``wait``;
        a second makes a running or coming ``stop`` kill at once instead of waiting for drains."""
        if self._interrupted.is_set():
            self._hurry.set()
        self._interrupted.set()

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send ``sig`` to one process (and its group), as a crash or an operator would; SIGKILL waits for it."""
        proc = self._procs[name]
        self._ended_on_purpose.add(name)
        self._signal(proc, sig)
        if sig == signal.SIGKILL:
            proc.popen.wait()

    def crash(self, name: str, sig: signal.Signals = signal.SIGKILL) -> int:
        """Kill one process (and its group) as the OOM killer or a fault would: not on purpose, so a
        supervising mesh restarts it. Returns the pid that was killed."""
        proc = self._procs[name]
        self._signal(proc, sig)
        return proc.pid

    @property
    def supervised(self) -> bool:
        """Whether crashed processes are restarted (a ``RestartPolicy`` was given)."""
        return self._restart is not None

    def restarts(self, name: str) -> int:
        """How many times the supervisor started ``name`` again."""
        record = self._records.get(name)
        return record.total_restarts if record is not None else 0

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- while running ---------------------------------------------------------

    def process(self, name: str) -> RunningProcess:
        return self._procs[name]

    def identity(self, role: str) -> TlsFiles | None:
        """``role``'s certificate in this mesh, to call its services as that role (None: a plaintext mesh)."""
        return None if self.topology.certs is None else role_identity(self.topology.certs, role)

    def address(self, name: str) -> str:
        return self.topology.get(name).address

    def crashed(self) -> list[str]:
        """Processes that exited without being stopped or killed through this object and stay down:
        all of them without a restart policy; with one, those the supervisor gave up on."""
        return [
            n
            for n, p in list(self._procs.items())
            if n not in self._ended_on_purpose
            and p.popen.poll() is not None
            and (self._restart is None or self._records[n].gave_up)
        ]

    def wait(self, known: Collection[str] = ()) -> str | None:
        """Block until a process not in ``known`` crashes (returns its name) or ``interrupt`` is called (None)."""
        while not self._interrupted.is_set():
            crashed = [n for n in self.crashed() if n not in known]
            if crashed:
                return crashed[0]
            self._interrupted.wait(_POLL_S)
        return None

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The last lines of a process's log, each prefixed with its name."""
        path = self.run_dir / "logs" / f"{name}.log"
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            return f"[{name}] (no log)"
        return "\n".join(f"[{name}] {line}" for line in text.splitlines()[-lines:])

    # -- supervision -------------------------------------------------------------

    def _supervise(self) -> None:
        """Until ``stop``: restart what crashed after its backoff, report when it serves again, give up on loops."""
        assert self._restart is not None
        policy = self._restart
        due: dict[str, float] = {}  # name -> when to start it again
        recovering: set[str] = set()  # restarted, not yet reported healthy
        channels: dict[str, grpc.Channel] = {}
        try:
            while not self._stopping.wait(_POLL_S):
                now = time.monotonic()
                for name, proc in list(self._procs.items()):
                    record = self._records[name]
                    if name in self._ended_on_purpose or record.gave_up or name in due or proc.popen.poll() is None:
                        continue
                    recovering.discard(name)
                    code = proc.popen.returncode
                    self._signal(proc, signal.SIGKILL)  # whatever it spawned and left behind in its group
                    delay = record.crashed(policy, now)
                    if delay is None:
                        self._progress(
                            f"{name} crashed {record.restarts_in_a_row + 1} times in a row (code {code}), each time "
                            f"within {policy.stable_after_s:g} s of starting: a crash loop; not restarting it again. "
                            f"Its last log lines:\n{self.log_tail(name)}"
                        )
                        continue
                    due[name] = now + delay
                    self._progress(
                        f"{name} exited unexpectedly (code {code}); restarting it in {delay:g} s "
                        f"(restart {record.restarts_in_a_row + 1} of at most {policy.max_restarts} in a row). "
                        f"Its last log lines:\n{self.log_tail(name)}"
                    )
                for name, when in list(due.items()):
                    if now >= when and not self._stopping.is_set():
                        del due[name]
                        self._spawn(self._procs[name].spec)
                        self._records[name].restarted(time.monotonic())
                        recovering.add(name)
                for name in list(recovering):
                    proc = self._procs[name]
                    if proc.popen.poll() is None and _healthy(proc.spec, channels):
                        recovering.discard(name)
                        self._progress(f"{name} is serving again (restart {self._records[name].total_restarts})")
        finally:
            for channel in channels.values():
                channel.close()

    # -- internals -------------------------------------------------------------

    def _spawn(self, spec: ProcessSpec) -> None:
        log_path = self.run_dir / "logs" / f"{spec.name}.log"
        if spec.workdir is not None:
            spec.workdir.mkdir(parents=True, exist_ok=True)
        # On a host of a multi-host mesh: `ip netns exec` joins its namespace, then execs the command.
        on_host = ("ip", "netns", "exec", spec.netns) if spec.netns else ()
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [sys.executable, str(EXEC_CHILD), str(os.getpid()), *on_host, *spec.argv],
                env={**os.environ, **spec.env},
                cwd=spec.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group
            )
        self._procs[spec.name] = RunningProcess(spec, popen, log_path)
        self._progress(f"started {spec.name} (pid {popen.pid})")

    def _wait_healthy(self, level: list[ProcessSpec], deadline: float) -> None:
        pending = [s.name for s in level]
        channels: dict[str, grpc.Channel] = {}
        try:
            while pending:
                if self._interrupted.is_set():
                    raise StartInterrupted(f"interrupted while waiting for {', '.join(pending)}")
                for name in list(pending):
                    proc = self._procs[name]
                    if proc.popen.poll() is not None:
                        raise MeshError(
                            f"{name} exited with code {proc.popen.returncode} during start-up",
                            name,
                            self.log_tail(name),
                        )
                    if _healthy(proc.spec, channels):
                        pending.remove(name)
                        self._progress(f"{name} is serving on {proc.spec.address}")
                if pending and time.monotonic() > deadline:
                    raise MeshError(
                        f"{', '.join(pending)} not healthy within {self._start_timeout_s:g} s",
                        pending[0],
                        self.log_tail(pending[0]),
                    )
                if pending:
                    self._interrupted.wait(_POLL_S)
        finally:
            for channel in channels.values():
                channel.close()

    def _stop_limit(self, spec: ProcessSpec) -> float:
        if self._stop_timeout_s is not None:
            return self._stop_timeout_s
        return spec.stop_grace_s if spec.stop_grace_s is not None else DEFAULT_STOP_TIMEOUT_S

    def _wait(self, proc: RunningProcess, deadline: float) -> bool:
        while proc.popen.poll() is None:
            if time.monotonic() > deadline or self._hurry.is_set():
                return False
            time.sleep(_POLL_S / 2)
        return True

    @staticmethod
    def _signal(proc: RunningProcess, sig: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, sig)  # the group's id is the leader's pid (start_new_session)
        except ProcessLookupError:
            pass  # already gone, group and all


def _healthy(spec: ProcessSpec, channels: dict[str, grpc.Channel]) -> bool:
    if spec.health == "redis":
        return _redis_answers(spec.host, spec.port, spec.redis_password_file)
    if spec.name not in channels:
        channels[spec.name] = create_blocking_channel(spec.address, spec.health_identity)
    try:
        reply = health_pb2_grpc.HealthStub(channels[spec.name]).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=1.0
        )
    except grpc.RpcError:
        return False  # not listening yet, or NOT_SERVING: still loading
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _redis_answers(host: str, port: int, password_file: Path | None) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            if password_file is not None:
                password = password_file.read_bytes().strip()
                s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(password), password))
                if not s.recv(16).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
