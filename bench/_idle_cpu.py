"""Wait until this machine's CPUs are idle, so a measured run does not share them with the one before it.

An engine can keep its cores busy after its run has returned (OpenMP threads spinning before they sleep, a server's
engine loop finishing its bookkeeping). On 2 cores the next engine's run then starts on a shared CPU, and the
engine that happens to run second in an alternation is the one that pays. Linux's /proc/stat counts every CPU's
busy time, whichever process spends it.
"""

from __future__ import annotations

import time

POLL_S = 0.1
# Busy share of all CPUs over one poll below which the machine counts as idle: this process's own polling and
# the system's daemons stay under it.
IDLE_BELOW = 0.05
MAX_WAIT_S = 15.0


def _busy_and_total() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal: a VM's steal (the host's other guests) is not ours to wait for
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    return busy, sum(fields[:8])


def wait_for_idle_cpu(max_wait_s: float = MAX_WAIT_S) -> float:
    """Block until one poll finds the CPUs idle (or ``max_wait_s`` passed); returns the seconds waited."""
    t0 = time.perf_counter()
    busy, total = _busy_and_total()
    while time.perf_counter() - t0 < max_wait_s:
        time.sleep(POLL_S)
        busy2, total2 = _busy_and_total()
        if total2 > total and (busy2 - busy) / (total2 - total) < IDLE_BELOW:
            break
        busy, total = busy2, total2
    return time.perf_counter() - t0
