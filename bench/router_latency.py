"""Routing decision latency against a real Redis on loopback.

    python bench/router_latency.py [--json out.json]

Starts its own ``redis-server`` on a free port, registers 8 workers with the
router core, fills the index the way a busy cluster would (each worker's GPU
cache holds ``--background-blocks`` unrelated blocks; the measured prompt's
prefix is held by several workers at different lengths and by the kvstore),
then times ``Router.route_chain`` (registry pull, the one-EVALSHA prefix walk,
the policy) for prompts of 1,000 and 12,500 blocks.

Anchor, same run, same client: one EXISTS over all the chain's keys, the
cheapest possible single round trip that touches every block. Also shown:
hashing the prompt's tokens into the chain (``Router.route`` does it before
the decision; a caller that sends a precomputed chain skips it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time

import structlog
import uvloop
from _common import cells, percentile, write_json
from _table import print_table

from kvmesh.blocks import block_hashes
from services.router.core import Router
from services.router.events import EventKind, KVEvent
from services.router.index import RedisPrefixIndex, Tier
from services.router.redis_store import connect
from services.router.registry import WorkerRegistry
from services.router.registry_store import RegistryStore
from services.router.worker import KVLayout, Role, WorkerCapacity, WorkerInfo, WorkerLoad

BLOCK_SIZE = 16
WORKERS = 8
LAYOUT = KVLayout(BLOCK_SIZE, "bfloat16", "layers,kv,block_tokens,kv_heads,head_dim", 32, 8, 128, b"\x07" * 16)
# How much of the measured prompt each worker holds (fractions of its blocks).
PREFIX_SHARE = {"w0": 1.0, "w1": 0.7, "w2": 0.3, "w3": 0.05}
KVSTORE_SHARE = 0.9


def start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not on PATH (Debian: apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(500):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, port
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise SystemExit("redis-server did not start")


async def fill_cluster(router: Router, prompts: dict[int, list[bytes]], background: int) -> None:
    for i in range(WORKERS):
        wid = f"w{i}"
        reg = await router.register(
            WorkerInfo(
                wid,
                Role.DECODE,
                f"10.0.0.{i}:50051",
                LAYOUT,
                WorkerCapacity(total_kv_blocks=65_536),
            )
        )
        events = [KVEvent(EventKind.STORED, Tier.GPU, [os.urandom(16) for _ in range(background)])]
        for chain in prompts.values():
            held = int(len(chain) * PREFIX_SHARE.get(wid, 0.002))
            events.append(KVEvent(EventKind.STORED, Tier.GPU, chain[:held]))
            if i == 0:
                events.append(KVEvent(EventKind.STORED, Tier.KVSTORE, chain[: int(len(chain) * KVSTORE_SHARE)]))
        await router.publish_kv_events(wid, reg.lease.lease_id, reg.expected_seq, events)
        load = WorkerLoad(
            queued_requests=i % 3,
            active_sequences=8 + i,
            free_kv_blocks=30_000,
            total_kv_blocks=65_536,
            tokens_in_flight=1_000 * i,
        )
        await router.heartbeat(wid, reg.lease.lease_id, load)


async def timed(fn, iters: int) -> list[float]:
    await fn()  # warm: script cache, connection
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


async def measure(args: argparse.Namespace, port: int) -> dict:
    client = connect(f"redis://127.0.0.1:{port}/0", timeout_s=2.0)
    router = Router(RedisPrefixIndex(client), WorkerRegistry(), RegistryStore(client))
    tokens = {n: list(range(n * BLOCK_SIZE)) for n in args.blocks}
    prompts = {n: block_hashes(t, BLOCK_SIZE, LAYOUT.model_fingerprint) for n, t in tokens.items()}
    await fill_cluster(router, prompts, args.background_blocks)
    results = {}
    for n, chain in prompts.items():
        keys = [b"kvmesh:blk:" + h for h in chain]
        plan = await router.route_chain(chain, num_tokens=n * BLOCK_SIZE, block_size=BLOCK_SIZE)
        decide = await timed(
            lambda chain=chain, n=n: router.route_chain(chain, num_tokens=n * BLOCK_SIZE, block_size=BLOCK_SIZE),
            args.iters,
        )
        anchor = await timed(lambda keys=keys: client.exists(*keys), args.iters)
        hashing = await timed(
            lambda t=tokens[n]: asyncio.to_thread(block_hashes, t, BLOCK_SIZE, LAYOUT.model_fingerprint),
            max(3, args.iters // 10),
        )
        results[str(n)] = {
            "decision_p50_ms": percentile(decide, 50),
            "decision_p99_ms": percentile(decide, 99),
            "exists_p50_ms": percentile(anchor, 50),
            "decision_vs_exists": percentile(decide, 50) / percentile(anchor, 50),
            "hash_tokens_p50_ms": percentile(hashing, 50),
            "matched_blocks": plan.matched_blocks,
            "chosen": plan.decode_worker,
        }
    await client.aclose()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--blocks",
        type=int,
        nargs="+",
        default=[1_000, 12_500],
        help="prompt sizes, in 16-token blocks",
    )
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--background-blocks", type=int, default=20_000, help="unrelated blocks per worker")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # As a deployed router would: per-request debug lines off.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))

    with tempfile.TemporaryDirectory() as workdir:
        proc, port = start_redis(workdir)
        try:
            results = uvloop.run(measure(args, port))
        finally:
            proc.kill()
            proc.wait()

    print(
        f"redis-server on loopback, {WORKERS} workers, "
        f"{args.background_blocks} background blocks each, {args.iters} decisions per size"
    )
    headers = ["blocks", "decision p50 ms", "p99 ms", "EXISTS p50 ms", "decision/EXISTS", "hash ms"]
    fields = [
        "decision_p50_ms",
        "decision_p99_ms",
        "exists_p50_ms",
        "decision_vs_exists",
        "hash_tokens_p50_ms",
    ]
    print_table(headers, [cells([n, *(r[f] for f in fields)]) for n, r in results.items()])
    biggest = results[str(max(args.blocks))]
    print(f"chosen for {max(args.blocks)} blocks: {biggest['chosen']}")
    print(f"matched blocks per worker: {biggest['matched_blocks']}")
    if "12500" in results:
        ok = results["12500"]["decision_p50_ms"] < 10
        print(f"goal: p50 < 10 ms at 12,500 blocks: {'ok' if ok else 'MISSED'}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
