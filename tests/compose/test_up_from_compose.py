"""`kvmesh up` (the real CLI, its own process) runs the compose file's mesh; an operator scales and drains one service.

One mesh for the module: starting one costs ~20 s here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.api.common.v1 import sampling_pb2, worker_pb2
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.launcher.compose import REPO_ROOT
from kvmesh.launcher.health_cli import check_health
from kvmesh.launcher.up_process import kvmesh_up
from kvmesh.runtime import create_channel
from kvmesh.runtime.certs import role_identity
from kvmesh.runtime.ports import free_port
from kvmesh.runtime.tls import TlsFiles
from tests.e2e.mesh_helpers import write_model

pytestmark = pytest.mark.timeout(300)

# Compose-level settings, passed the way an operator would (environment or compose/.env).
COMPOSE_SETTINGS = {"KVMESH_PREFILL_NUM_BLOCKS": "128", "KVMESH_DECODE_NUM_BLOCKS": "128"}


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any KVMESH_* setting of the developer's, eager decode steps (compiling costs a
    start minutes; tests/engine/test_compile_cache.py has that path), plus ``extra``."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")} | {"KVMESH_DECODE_COMPILE": "0"} | extra


@dataclass
class Up:
    proc: subprocess.Popen
    run_dir: Path
    plan: dict[str, dict]  # topology.json, by process name
    model: Path

    def address(self, name: str) -> str:
        return f"{self.plan[name]['host']}:{self.plan[name]['port']}"

    def metrics_port(self, name: str) -> int:
        return self.plan[name]["metrics_port"]

    def identity(self, role: str) -> TlsFiles:
        """``role``'s certificate from the CA ``kvmesh up`` made in its run folder."""
        return role_identity(self.run_dir / "volumes" / "certs", role)


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[Up]:
    model = write_model(tmp_path_factory.mktemp("compose-model") / "llama")
    run_dir = tmp_path_factory.mktemp("up")
    flags = ["--model", str(model), "--device", "cpu", "--no-publish", "--log-level", "warning"]
    with kvmesh_up(run_dir, *flags, env=_clean_env(**COMPOSE_SETTINGS)) as up:
        yield Up(up.proc, run_dir, up.plan, model)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


def _greedy(n: int) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def _complete(gateway, prompt: list[int], n: int) -> list[int]:
    tokens: list[int] = []
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=_greedy(n))
    async for msg in gateway.Generate(request):
        tokens += msg.token_ids
    return tokens


async def _decode_workers(router) -> set[str]:
    reply = await router.ListWorkers(router_pb2.ListWorkersRequest(role=worker_pb2.WORKER_ROLE_DECODE))
    return {w.endpoint.worker_id for w in reply.workers}


async def test_kvmesh_up_runs_the_compose_files_mesh_and_streams_a_completion(up: Up) -> None:
    assert list(up.plan) == ["redis", "router", "kvstore", "speculator", "prefill-0", "decode-0", "gateway"]
    decode = up.plan["decode-0"]
    # The compose file's settings, its ${VAR}s from the environment, its addresses mapped here.
    assert decode["env"]["KVMESH_NUM_BLOCKS"] == "128" and decode["env"]["KVMESH_DEVICE"] == "cpu"
    assert decode["env"]["KVMESH_SPECULATOR_ADDRESS"] == up.address("speculator")
    assert up.plan["kvstore"]["env"]["KVMESH_DISK_DIR"] == str(up.run_dir / "volumes" / "kvstore-data")
    assert up.plan["router"]["env"]["KVMESH_REDIS_URL"] == f"redis://{up.address('redis')}/0"
    # Mutual TLS by default: each service with its role's certificate; plaintext is refused inside.
    assert decode["env"]["KVMESH_TLS_CERT"] == str(up.identity("decode").cert)
    async with grpc.aio.insecure_channel(up.address("router")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router_pb2_grpc.RouterServiceStub(channel).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    async with grpc.aio.insecure_channel(up.address("gateway")) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GenerateRequest(text="def fibonacci(n):", sampling=_greedy(12))
        chunks = [msg async for msg in gateway.Generate(request)]

    assert len(chunks) > 1  # streamed, not one reply
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert chunks[-1].final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].final.usage.completion_tokens == 12


async def test_a_decode_worker_added_to_the_running_mesh_takes_requests_then_drains_on_sigterm(up: Up) -> None:
    port, metrics_port = free_port(), free_port()
    # The service alone, with only flags: what an operator runs to scale decode out.
    argv = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        "decode",
        "--router-address",
        up.address("router"),
        "--model",
        str(up.model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--worker-id",
        "decode-extra",
        "--num-blocks",
        "128",
        "--grace-seconds",
        "20",
        "--tls-ca",
        str(up.identity("decode").ca),
        "--tls-cert",
        str(up.identity("decode").cert),
        "--tls-key",
        str(up.identity("decode").key),
    ]
    with open(up.run_dir / "decode-extra.log", "w") as log:
        extra = subprocess.Popen(argv, cwd=REPO_ROOT, env=_clean_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        async with (
            grpc.aio.insecure_channel(up.address("gateway")) as gch,
            create_channel(up.address("router"), up.identity("operator")) as rch,
        ):
            gateway = gateway_pb2_grpc.GatewayServiceStub(gch)
            router = router_pb2_grpc.RouterServiceStub(rch)
            await _wait_for_worker(extra, port, router, up.identity("operator"))

            # The router starts using it: fresh prompts (nobody holds their prefix) reach both workers.
            for i in range(20):
                assert len(await _complete(gateway, [100 + i, 7, 8, 9, 10], 4)) == 4
                if scrape(metrics_port)["kvmesh_decode_requests_total"] > 0:
                    break
            assert scrape(metrics_port)["kvmesh_decode_requests_total"] > 0

            call, tokens = await _stream_on(gateway, metrics_port)
            extra.send_signal(signal.SIGTERM)

            # Drain: it leaves routing first...
            for _ in range(200):
                if await _decode_workers(router) == {"decode-0"}:
                    break
                await asyncio.sleep(0.05)
            assert await _decode_workers(router) == {"decode-0"}
            # ...so new requests go to the other worker...
            before = scrape(up.metrics_port("decode-0"))["kvmesh_decode_requests_total"]
            for i in range(3):
                assert len(await _complete(gateway, [200 + i, 1, 2, 3], 3)) == 3
            assert scrape(up.metrics_port("decode-0"))["kvmesh_decode_requests_total"] == before + 3

            # ...while the request in flight on it finishes, every token delivered.
            final = None
            while (msg := await call.read()) != grpc.aio.EOF:
                tokens += len(msg.token_ids)
                final = msg.final if msg.HasField("final") else final
            assert (await call.code()) == grpc.StatusCode.OK
            assert final is not None and final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            assert tokens == _LONG

        assert extra.wait(timeout=60) == 0  # drained and stopped within its grace period
    finally:
        if extra.poll() is None:
            extra.kill()
            extra.wait()


_LONG = 300


async def _wait_for_worker(proc: subprocess.Popen, port: int, router, identity: TlsFiles) -> None:
    for _ in range(1200):
        assert proc.poll() is None, f"the added decode worker exited with code {proc.returncode}"
        serving, _ = await asyncio.to_thread(check_health, f"127.0.0.1:{port}", "", 1.0, identity)
        if serving and "decode-extra" in await _decode_workers(router):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the added decode worker never registered")


async def _stream_on(gateway, metrics_port: int) -> tuple[grpc.aio.UnaryStreamCall, int]:
    """A long stream the added worker is serving (retried until the router puts one there), and its tokens so far."""
    for i in range(20):
        prompt = [300 + i, 5, 6, 7, 8, 9]
        call = gateway.Generate(
            gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=_greedy(_LONG))
        )
        first = await call.read()
        if scrape(metrics_port)["kvmesh_decode_active_requests"] == 1:
            return call, len(first.token_ids)
        call.cancel()
    raise AssertionError("no long request was routed to the added decode worker")
