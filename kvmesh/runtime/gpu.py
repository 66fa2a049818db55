"""GPU memory and utilization from NVML, when there is a GPU.

Workers put these in their heartbeats and /metrics. Without an NVIDIA driver
(CPU development, CI) every call returns an empty list: no error, no log spam.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class GpuStats:
    """One GPU. Field names match ``kvmesh.api.common.v1.GpuStats`` so ``GpuStats(**asdict(s))`` converts."""

    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: int


@functools.cache
def _nvml() -> ModuleType | None:
    # Initialised once per process: nvmlInit is slow-ish and its failure (no
    # library, no driver) will not change while the process runs.
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, or any NVMLError subclass
        return None
    return pynvml


def _visible(index: int, uuid: str, cuda_visible_devices: str | None) -> bool:
    """Whether CUDA_VISIBLE_DEVICES (indices or UUID prefixes) exposes this GPU to the process.

    NVML sees every GPU of the machine; a service pinned to one GPU reports that one.
    """
    if cuda_visible_devices is None:
        return True
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry == str(index) or (entry.startswith("GPU-") and uuid.startswith(entry)):
            return True
    return False


def _utilization(nvml: ModuleType, handle: object) -> int:
    try:
        return int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except nvml.NVMLError:  # not supported (MIG mode): memory is still worth reporting
        return 0


def gpu_stats() -> list[GpuStats]:
    """Stats of the GPUs this process may use; empty without NVML."""
    nvml = _nvml()
    if nvml is None:
        return []
    pinned = os.environ.get("CUDA_VISIBLE_DEVICES")
    out = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            if not _visible(i, nvml.nvmlDeviceGetUUID(handle), pinned):
                continue
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(GpuStats(i, nvml.nvmlDeviceGetName(handle), mem.used, mem.total, _utilization(nvml, handle)))
    except nvml.NVMLError:
        # A GPU lost mid-query (driver reset, Xid): report nothing rather than fail a heartbeat.
        return []
    return out
