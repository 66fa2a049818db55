"""/metrics serves the RPC counters; several services fit in one process; GPU stats are optional."""

from __future__ import annotations

import asyncio
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.runtime import GpuStats, Runtime, gpu, gpu_stats, serve
from kvmesh.runtime.gpu import _visible
from tests.runtime.fakes import build_kvstore


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _value(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


SVC = "kvmesh.api.kvstore.v1.KVStoreService"


async def test_metrics_count_rpcs_by_code(kvstore: Runtime, kvstore_stub: kvstore_pb2_grpc.KVStoreServiceStub) -> None:
    await kvstore_stub.Stats(kvstore_pb2.StatsRequest())
    await kvstore_stub.Stats(kvstore_pb2.StatsRequest())
    try:
        await kvstore_stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=[b"missing"]))
    except grpc.aio.AioRpcError:
        pass
    text = await asyncio.to_thread(_scrape, kvstore.metrics_port)
    assert _value(text, "kvmesh_rpc_requests_total", service=SVC, method="Stats", code="OK") == 2
    assert _value(text, "kvmesh_rpc_requests_total", service=SVC, method="Lookup", code="NOT_FOUND") == 1
    assert _value(text, "kvmesh_rpc_duration_seconds_count", service=SVC, method="Stats") == 2
    assert _value(text, "kvmesh_rpc_in_flight", service=SVC, method="Stats") == 0
    assert "process_resident_memory_bytes" in text
    # Health checks are not counted as the service's RPCs.
    assert "grpc.health" not in text


async def test_two_services_in_one_process_have_their_own_metrics(kvstore: Runtime) -> None:
    async with serve("kvstore-2", build_kvstore) as other:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{other.port}") as channel:
            await kvstore_pb2_grpc.KVStoreServiceStub(channel).Stats(kvstore_pb2.StatsRequest())
        assert other.metrics_port != kvstore.metrics_port
        counter = ("kvmesh_rpc_requests_total",)
        labels = {"service": SVC, "method": "Stats", "code": "OK"}
        assert _value(await asyncio.to_thread(_scrape, other.metrics_port), *counter, **labels) == 1
        assert _value(await asyncio.to_thread(_scrape, kvstore.metrics_port), *counter, **labels) is None


def test_gpu_stats_never_raise() -> None:
    stats = gpu_stats()
    if gpu._nvml() is None:  # no NVIDIA driver (CI): silently nothing
        assert stats == []
    else:
        assert all(s.memory_total_bytes > 0 for s in stats)


class _FakeNvml:
    """Two GPUs; the second one is in MIG mode, where utilization is not supported."""

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}{h}{h}"

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=(h + 1) << 30, total=141 << 30)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        if h == 1:
            raise self.NVMLError("not supported")
        return SimpleNamespace(gpu=87)


async def test_gpu_stats_and_metrics_with_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_nvml", lambda: _FakeNvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_stats() == [
        GpuStats(0, "NVIDIA H200", 1 << 30, 141 << 30, 87),
        GpuStats(1, "NVIDIA H200", 2 << 30, 141 << 30, 0),
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-111")
    assert [s.index for s in gpu_stats()] == [1]
    async with serve("decode", build_kvstore) as rt:
        text = await asyncio.to_thread(_scrape, rt.metrics_port)
    assert _value(text, "kvmesh_gpu_memory_used_bytes", gpu="1") == 2 << 30
    assert _value(text, "kvmesh_gpu_utilization_percent", gpu="1") == 0


def test_cuda_visible_devices_filter() -> None:
    assert _visible(0, "GPU-aaaa", None)
    assert _visible(1, "GPU-bbbb", "1")
    assert not _visible(0, "GPU-aaaa", "1,2")
    assert _visible(3, "GPU-abcdef", "GPU-abc")
    assert not _visible(0, "GPU-aaaa", "")
