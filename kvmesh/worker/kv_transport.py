"""How a worker moves KV blocks to a peer: the one definition of ``--kv-transport``.

``nixl``: the bytes go over NIXL (a peer READs them straight out of the pool;
gRPC carries only control: leases, descriptors, agent metadata). ``grpc``: the
chunked PullKV stream. The same flag picks the kvstore's data plane (PutNixl /
GetNixl where both ends have NIXL, the Put/Get chunk streams otherwise). Where
NIXL does not load (not installed, no usable UCX transport) a process asked for
``nixl`` says so and runs on gRPC; a peer that lacks NIXL is served over gRPC
either way. A tensor-parallel worker has an agent on every rank
(``kvmesh.worker.rank_nixl``); its kvstore traffic stays on gRPC (the kvstore's
arena is read and written whole blocks at a time).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import structlog

from kvmesh.runtime import Flag

if TYPE_CHECKING:
    from kvmesh.engine.kv_cache import KVCache
    from kvmesh.engine.sharded_kv import ShardedKVCache
    from kvmesh.worker.kv_nixl import NixlEndpoint
    from kvmesh.worker.rank_nixl import RankEndpoints

log = structlog.get_logger(__name__)

KV_TRANSPORTS = ("nixl", "grpc")

# NIXL's progress thread pauses this long between rounds (kv_nixl._agent_with_paced_progress).
# Each round wakes a thread on the cores the engine's OpenMP team runs on, slowing its steps; at
# this pause READs move as fast as with a busier thread (docs/measurements.md).
DEFAULT_PROGRESS_PAUSE_US = 2000

KV_TRANSPORT_FLAGS = [
    Flag(
        "--kv-transport",
        "how KV blocks move between workers: nixl (gRPC fallback where it does not load) or grpc",
        default="nixl",
        choices=KV_TRANSPORTS,
    ),
    Flag(
        "--kv-read-timeout-s",
        "a NIXL READ still in progress after this (plus 1 s per 100 MB) is abandoned",
        default=10.0,
        type=float,
    ),
    Flag(
        "--nixl-progress-pause-us",
        "pause of NIXL's progress thread between rounds: shorter serves READs sooner, "
        "longer takes less CPU from the engine",
        default=DEFAULT_PROGRESS_PAUSE_US,
        type=int,
    ),
]


def read_timeout_s(floor_s: float, nbytes: int) -> float:
    """The deadline of one READ: a floor for the handshake-free overhead plus a slow link's pace."""
    return floor_s + nbytes / 100e6


def load_transport(args: argparse.Namespace) -> Any | None:
    """NIXL's Python API when ``--kv-transport nixl`` and it loads, else None (gRPC)."""
    if args.kv_transport != "nixl":
        return None
    from kvmesh.worker.kv_nixl import load_nixl

    nixl = load_nixl()
    if nixl is None:
        log.warning("NIXL is not installed; KV moves over gRPC", wanted="nixl")
    return nixl


def open_endpoint(args: argparse.Namespace, kv: KVCache | ShardedKVCache, role: str) -> RankEndpoints | None:
    """This worker's NIXL endpoints, every rank's pool registered (``kv``'s), or None for gRPC. Blocking."""
    nixl = load_transport(args)
    if nixl is None:
        return None
    from kvmesh.worker.kv_nixl import NixlEndpoint
    from kvmesh.worker.rank_nixl import RankEndpoints

    try:
        endpoint = NixlEndpoint(nixl, kv.tensor, role, args.nixl_progress_pause_us)
    except Exception as e:  # noqa: BLE001 - NIXL/UCX raise their own types; any of them means no NIXL here
        log.warning("NIXL did not start; KV moves over gRPC", error=str(e))
        return None
    try:
        ranks = RankEndpoints.open(endpoint, kv, role, args.nixl_progress_pause_us)
    except Exception as e:  # noqa: BLE001 - a follower's NIXL failed to start (its reason in the message)
        endpoint.close()
        log.warning("NIXL did not start on every tensor-parallel rank; KV moves over gRPC", error=str(e))
        return None
    log.info(
        "KV pool registered with NIXL",
        agent=endpoint.name,
        mem_type=endpoint.region.mem_type,
        bytes=endpoint.region.num_blocks * endpoint.region.block_nbytes,
        ranks=len(ranks.head_ranges),
    )
    return ranks


def whole_block_endpoint(ranks: RankEndpoints | None) -> NixlEndpoint | None:
    """The endpoint that moves whole blocks (the kvstore's transfers): a worker of one rank's, else None."""
    return ranks.local if ranks is not None and not ranks.sharded else None
