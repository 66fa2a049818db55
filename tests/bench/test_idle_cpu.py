"""bench/_idle_cpu.py: a measured run waits while the CPUs are busy, and no longer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _idle_cpu  # noqa: E402


def test_waits_through_busy_polls_and_stops_at_the_first_idle_one(monkeypatch):
    # (busy, total) jiffies: two polls at 50% busy, then one at 2%, then more busy ones that must not be read.
    readings = iter([(0, 0), (50, 100), (100, 200), (102, 300), (200, 400), (300, 500)])
    read = []
    monkeypatch.setattr(_idle_cpu, "_busy_and_total", lambda: read.append(1) or next(readings))
    monkeypatch.setattr(_idle_cpu, "POLL_S", 0.0)
    _idle_cpu.wait_for_idle_cpu(max_wait_s=60.0)
    assert len(read) == 4


def test_spinning_processes_keep_the_cpus_busy_until_the_wait_gives_up():
    # Enough spinners to hold a tenth of the machine's CPUs, twice the idle threshold, on any core count.
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(-(-os.cpu_count() // 10))]
    try:
        assert _idle_cpu.wait_for_idle_cpu(max_wait_s=0.5) >= 0.5
    finally:
        for p in spinners:
            p.kill()
            p.wait()
