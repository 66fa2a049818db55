"""Wiring an engine worker (prefill, decode) to the router through a ``RouterLink``.

The engine's ``BlockManager`` reports every block it names or drops
(``on_event("stored" | "removed", hashes)``, on the engine thread, after the
change); those become GPU-tier KV events. Registration carries the engine's
KV layout and capacity, heartbeats its load (LoRA adapters included).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.blocks import BlockHash
from kvmesh.models.sources import served_name
from kvmesh.runtime import gpu_stats
from kvmesh.worker.adapters import adapter_states
from kvmesh.worker.link_metrics import register_link_metrics
from kvmesh.worker.router_link import RouterLink

if TYPE_CHECKING:  # the kvstore imports this package without torch
    from kvmesh.engine.engine import LLMEngine


def engine_load(engine: LLMEngine) -> worker_pb2.WorkerLoad:
    """The engine's load for a heartbeat. Read from the event loop while the engine
    thread steps: each figure is a length or a copy, a snapshot good enough for routing."""
    return worker_pb2.WorkerLoad(
        queued_requests=engine.num_waiting,
        active_sequences=engine.num_running,
        free_kv_blocks=engine.blocks.num_free,
        total_kv_blocks=engine.config.num_blocks,
        tokens_in_flight=engine.tokens_in_flight,
        gpus=[worker_pb2.GpuStats(**asdict(g)) for g in gpu_stats()],
        adapters=adapter_states(engine),
    )


def engine_snapshot(engine: LLMEngine) -> dict[int, list[BlockHash]]:
    """Every block the engine's cache names. ``list(dict)`` copies the keys in one
    step under the GIL, so this is safe while the engine thread changes the dict."""
    return {kv_pb2.KV_TIER_GPU: list(engine.blocks.hash_to_block)}


async def attach_router(
    args: argparse.Namespace,
    engine: LLMEngine,
    role: int,
    address: str,
    name: str,
    registry: CollectorRegistry | None = None,
) -> RouterLink | None:
    """Start a link for this worker when ``--router-address`` is set (None otherwise).

    ``role`` is a ``worker_pb2.WorkerRole``; ``address`` what others dial; the
    worker id is ``--worker-id`` or ``<name>-<address>``. Call ``stop()`` on the
    link in the service's drain hook. Blocks the engine already holds are
    covered by the first snapshot, so attaching after the engine started is fine.
    """
    if not args.router_address:
        return None
    link = RouterLink(
        args.router_address,
        worker_id=args.worker_id or f"{name}-{address}",
        role=role,
        address=address,
        layout=kv_pb2.KVLayout(**engine.kv_layout()),
        capacity=router_pb2.WorkerCapacity(
            total_kv_blocks=engine.config.num_blocks,
            max_num_seqs=engine.config.max_num_seqs,
            max_model_len=engine.max_model_len,
        ),
        model=served_name(args.model) if args.model else "default",
        load_fn=lambda: engine_load(engine),
        snapshot_fn=lambda: engine_snapshot(engine),
    )

    def on_block_event(kind: str, hashes: list[BlockHash]) -> None:
        link.publish(kind, hashes, kv_pb2.KV_TIER_GPU)

    engine.blocks.on_event = on_block_event
    if registry is not None:
        register_link_metrics(link, registry)
    await link.start()
    return link
