"""An engine worker's link: a real (tiny, CPU) engine's block events reach the router's index."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.runtime import serve
from kvmesh.sampling import SamplingParams
from kvmesh.worker.engine_link import attach_router
from tests.engine.conftest import write_checkpoint
from tests.worker.fake_router import RouterState, build_fake_router
from tests.worker.polling import until

GPU = kv_pb2.KV_TIER_GPU


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama-gqa")


def args(router_address: str | None) -> argparse.Namespace:
    return argparse.Namespace(router_address=router_address, worker_id=None, model="/models/tiny-llama")


async def test_engine_blocks_are_published_and_snapshotted(checkpoint: Path) -> None:
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", block_size=16, num_blocks=8, max_num_seqs=4))
    prompt = list(range(1, 41))  # two full blocks and a partial one
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # cached before the link exists
    held_before = set(engine.blocks.hash_to_block)
    assert len(held_before) == 2

    state = RouterState()
    async with serve("router", build_fake_router(state), metrics_port=None) as router:
        link = await attach_router(
            args(f"127.0.0.1:{router.port}"), engine, worker_pb2.WORKER_ROLE_DECODE, "127.0.0.1:7000", "decode"
        )
        assert link is not None and link.worker_id == "decode-127.0.0.1:7000"
        await until(lambda: state.resyncs, "the first snapshot")
        assert state.blocks(link.worker_id, GPU) == held_before
        (registration,) = state.registrations
        assert registration.layout == kv_pb2.KVLayout(**engine.kv_layout())
        assert (registration.capacity.total_kv_blocks, registration.capacity.max_num_seqs) == (8, 4)
        assert registration.model == "tiny-llama"

        # The engine steps on its own thread; a second prompt evicts the first one's cached blocks.
        other = list(range(100, 180))
        await asyncio.to_thread(engine.generate, [other], SamplingParams(temperature=0.0, max_tokens=2))
        held = set(engine.blocks.hash_to_block)
        assert held != held_before
        await until(lambda: state.blocks(link.worker_id, GPU) == held, "the index to follow the engine")

        # One heartbeat may have been built before the request finished; the one after it was not.
        sent = len(state.heartbeats)
        await until(lambda: len(state.heartbeats) > sent + 1, "a heartbeat built after the request finished")
        load = state.heartbeats[-1].load
        assert (load.total_kv_blocks, load.free_kv_blocks, load.active_sequences) == (8, 8, 0)
        await link.stop()
        assert state.deregistered == [link.worker_id]


async def test_no_router_address_no_link(checkpoint: Path) -> None:
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", num_blocks=4))
    assert await attach_router(args(None), engine, worker_pb2.WORKER_ROLE_PREFILL, "x:1", "prefill") is None
    assert engine.blocks.on_event is None
