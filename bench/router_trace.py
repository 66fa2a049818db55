"""Replay a Mooncake-format trace through the router's policy against simulated workers.

    python bench/router_trace.py --trace ../shared/traces/conversation_trace.jsonl [--json out.json]

Each trace line is one request: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (chained ids of 512-token blocks; the last may
name a partial block). The router's real code decides: ``CacheAwarePolicy``
over an ``InMemoryPrefixIndex`` fed through ``KVEventApplier`` by the simulated
workers' cache events, exactly as workers feed the service. The baselines,
``RoundRobinPolicy`` and ``LeastLoadedPolicy``, run against the same workers in
the same run.

Time model (a 70B-class model on one 8-GPU node per worker, the Mooncake
paper's setting; constants in ``TimeModel``):

- A worker prefills one request at a time, first come first served, at
  ``prefill_tokens_per_s`` for the linear part plus attention over every
  (new token, earlier token) pair, plus a fixed cost per prefill. TTFT =
  queueing + prefill: the first token is sampled at the end of the prefill.
- Decoding runs beside prefill (disaggregated or chunked, it does not stall
  the prefill queue); a sequence decodes for ``decode_s_per_token`` per output
  token and holds its KV blocks meanwhile. Its GPU time, for the load figure,
  is that divided by ``decode_batch`` (one step serves a batch).
- Each worker has an LRU KV cache of ``--capacity-tokens``. Blocks a queued or
  running request uses are pinned; a finished prompt's blocks are touched
  last-block-first, so a chain's parents outlive its children (as an engine
  freeing a sequence back to front does). Workers report exact load at every
  arrival.
- Every worker is a decode-role worker (prefill and decode on one engine), so
  the routing choice is where a request runs; prefill-only workers and KV
  hand-offs are outside this model.
- The kvstore (``--kvstore-capacity-tokens``; 0 leaves it out) is one
  cluster-wide LRU store of blocks, filled and read the way workers use it
  (``kvmesh/worker/kv_tiers.py``, ``services/kvstore/core.py``): a finished
  prefill writes the prompt's held blocks behind to it in chain order (a
  block already there is only touched); a prefill first fetches the
  leading blocks the store holds beyond the worker's GPU prefix, which land
  in the worker's GPU cache, and computes only the rest. The store publishes
  its STORED / REMOVED events as the kvstore service does (its own worker id,
  tier KVSTORE), so the policy sees them as ``PrefixHits.kvstore_blocks``.
  A fetch costs ``TimeModel.fetch_s`` per block on the prefilling worker,
  before its prefill (RAM and disk tiers are modelled at one bandwidth).

Fetch cost: a Llama-2-70B-class model keeps K and V for 80 layers x 8 KV heads
(GQA) x 128 dims in fp16: 80 x 8 x 128 x 2 x 2 B = 320 KiB per token (its
config.json), 160 MiB per 512-token block. At 25 GB/s (one 200 Gb/s RDMA NIC
or a PCIe 4.0 x16 link; Mooncake's nodes have several NICs, so this is the
conservative end) a block takes 6.7 ms, against 64 ms (+ attention) to
recompute it at 8k tokens/s: about 0.1x, the policy's ``kvstore_fetch_cost``.
Default capacity, 32M tokens: about 10 TB of KV, 1.3 TB of RAM + NVMe per
node for 8 nodes, a modest share of what such nodes carry.

Figures: hit rate is token-weighted at block granularity (blocks not
recomputed, found on the prefilling worker's GPU or fetched from the
kvstore / blocks in the prompt, every block 512 tokens; ``gpu_hit_rate`` is
the GPU part alone),
which is also how the ideal (an infinite cache shared by all workers) is
counted; load is each worker's GPU-busy seconds, reported as max/mean. A
second reference is one LRU cache as big as all workers' together: with LRU
caches, what perfect placement (no block cached twice) would hit.

Every run reports two configurations: the one asked for (the top-level keys
of ``--json``) and, when that has a kvstore, the GPU caches alone (under
``"gpu_only"``), so both stand side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from _common import cells, percentile, write_json
from _table import print_table

from services.router.events import EventKind, KVEvent, KVEventApplier
from services.router.index import InMemoryPrefixIndex, Tier
from services.router.policy import (
    CacheAwarePolicy,
    Candidate,
    LeastLoadedPolicy,
    Policy,
    RoundRobinPolicy,
    RouteInput,
)
from services.router.worker import Role, WorkerLoad

TRACE_BLOCK_SIZE = 512  # tokens per hash id (Mooncake's traces)
KVSTORE_ID = "kvstore"  # the id the kvstore registers under (never a routing candidate)
# K and V, per token, of a Llama-2-70B-class model: 80 layers x 8 KV heads x 128 dims x 2 B (fp16).
KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2


@dataclass(frozen=True)
class TimeModel:
    # 8k tokens/s: 140 GFLOP per token of a 70B model at ~1.1 PFLOP/s (45% of 8 A800s).
    prefill_tokens_per_s: float = 8000.0
    # Per prefill: scheduling, sampling the first token.
    prefill_fixed_s: float = 0.02
    # Attention FLOPs per (new, earlier) token pair (80 layers x 8192 wide x 4)
    # relative to a token's linear FLOPs (140 GFLOP), at the same rate.
    attn_pair_per_token: float = 80 * 8192 * 4 / 140e9
    # Time per output token of one sequence.
    decode_s_per_token: float = 0.04
    # Sequences one decode step serves (the GPU time per output token is the step / this).
    decode_batch: int = 32
    # KV bytes of one trace block, and the kvstore-to-GPU bandwidth (see module doc).
    kvstore_block_bytes: int = KV_BYTES_PER_TOKEN * TRACE_BLOCK_SIZE
    kvstore_bytes_per_s: float = 25e9

    def fetch_s(self, blocks: int) -> float:
        return blocks * self.kvstore_block_bytes / self.kvstore_bytes_per_s

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        pairs = new_tokens * (cached_tokens + new_tokens / 2)
        return self.prefill_fixed_s + (new_tokens + pairs * self.attn_pair_per_token) / self.prefill_tokens_per_s


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(
                TraceRequest(
                    r["timestamp"] / 1000,
                    r["input_length"],
                    r["output_length"],
                    tuple(r["hash_ids"]),
                )
            )
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out


def ideal_hit_rate(trace: list[TraceRequest]) -> float:
    """Hit rate of one infinite cache shared by every worker."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace:
        n = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            n += 1
        hit += n
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


class LRUKVCache:
    """A worker's KV cache: LRU over unpinned blocks, pinned blocks never evicted."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned, oldest first
        self._pins: dict[int, int] = {}
        self.private_blocks = 0  # output KV: pinned, nameless

    def used(self) -> int:
        return len(self._lru) + len(self._pins) + self.private_blocks

    def pinned(self) -> int:
        return len(self._pins) + self.private_blocks

    def prefix_len(self, ids: tuple[int, ...]) -> int:
        n = 0
        for h in ids:
            if h not in self._lru and h not in self._pins:
                break
            n += 1
        return n

    def pin(self, ids) -> None:
        for h in ids:
            if h in self._pins:
                self._pins[h] += 1
            else:
                self._lru.pop(h, None)
                self._pins[h] = 1

    def unpin(self, ids) -> None:
        for h in reversed(ids):  # parents end up most recent
            left = self._pins[h] - 1
            if left:
                self._pins[h] = left
            else:
                del self._pins[h]
                self._lru[h] = None

    def store(self, ids) -> tuple[list[int], list[int]]:
        """Cache ``ids`` (touching those present); returns (newly stored, evicted)."""
        stored = []
        for h in reversed(ids):
            if h in self._pins:
                continue
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = None
                stored.append(h)
        return stored, self.evict_overflow()

    def evict_overflow(self) -> list[int]:
        evicted = []
        while self.used() > self.capacity and self._lru:
            evicted.append(self._lru.popitem(last=False)[0])
        return evicted


class KVStoreTier:
    """The cluster's kvstore: LRU over every block put, as ``services/kvstore/core.py``
    (a put of a present block and a get both count as use; a lookup touches nothing)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first

    def prefix_len(self, ids: tuple[int, ...]) -> int:
        n = 0
        for h in ids:
            if h not in self._lru:
                break
            n += 1
        return n

    def get(self, ids) -> None:
        for h in ids:
            self._lru.move_to_end(h)

    def put(self, ids) -> tuple[list[int], list[int]]:
        """Store ``ids`` in order; returns (newly stored, evicted)."""
        stored, evicted = [], []
        for h in ids:
            if h in self._lru:
                self._lru.move_to_end(h)
                continue
            self._lru[h] = None
            stored.append(h)
            while len(self._lru) > self.capacity:
                evicted.append(self._lru.popitem(last=False)[0])
        return stored, evicted


@dataclass
class SimWorker:
    worker_id: str
    role: Role
    cache: LRUKVCache
    busy_until: float = 0.0
    busy_s: float = 0.0
    prefill_starts: list[float] = field(default_factory=list)  # heap of queued jobs' starts
    decode_ends: list[float] = field(default_factory=list)  # heap of running sequences' ends
    seq: int = 0

    def load(self, now: float, tm: TimeModel) -> WorkerLoad:
        while self.prefill_starts and self.prefill_starts[0] <= now:
            heapq.heappop(self.prefill_starts)
        prefill_left = max(0.0, self.busy_until - now) * tm.prefill_tokens_per_s
        decode_left = sum(max(0.0, e - now) for e in self.decode_ends) / tm.decode_s_per_token
        return WorkerLoad(
            queued_requests=len(self.prefill_starts),
            active_sequences=len(self.decode_ends),
            free_kv_blocks=self.cache.capacity - self.cache.pinned(),
            total_kv_blocks=self.cache.capacity,
            tokens_in_flight=int(prefill_left + decode_left),
        )


class Simulation:
    def __init__(
        self,
        trace: list[TraceRequest],
        policy: Policy,
        workers: int,
        capacity_tokens: int,
        tm: TimeModel,
        kvstore_capacity_tokens: int = 0,
    ) -> None:
        self.trace = trace
        self.policy = policy
        self.tm = tm
        blocks = capacity_tokens // TRACE_BLOCK_SIZE
        # Every worker a full engine (a decode worker): it prefills what it decodes.
        self.workers = {f"w{i}": SimWorker(f"w{i}", Role.DECODE, LRUKVCache(blocks)) for i in range(workers)}
        kv_blocks = kvstore_capacity_tokens // TRACE_BLOCK_SIZE
        self.kvstore = KVStoreTier(kv_blocks) if kv_blocks > 0 else None
        self.kvstore_seq = 0
        self.index = InMemoryPrefixIndex()
        self.events = KVEventApplier(self.index)
        self._timers: list[tuple[float, int, str, tuple]] = []
        self._order = itertools.count()

    async def _publish(self, w: SimWorker, stored: list[int], evicted: list[int]) -> None:
        batch = [KVEvent(EventKind.STORED, Tier.GPU, stored)] if stored else []
        if evicted:
            batch.append(KVEvent(EventKind.REMOVED, Tier.GPU, evicted))
        if batch:
            w.seq += 1
            result = await self.events.publish(w.worker_id, w.seq, batch)
            assert result.accepted, result.message

    async def _publish_kvstore(self, stored: list[int], evicted: list[int]) -> None:
        batch = [KVEvent(EventKind.STORED, Tier.KVSTORE, stored)] if stored else []
        if evicted:
            batch.append(KVEvent(EventKind.REMOVED, Tier.KVSTORE, evicted))
        if batch:
            self.kvstore_seq += 1
            result = await self.events.publish(KVSTORE_ID, self.kvstore_seq, batch)
            assert result.accepted, result.message

    def _at(self, t: float, kind: str, *args) -> None:
        heapq.heappush(self._timers, (t, next(self._order), kind, args))

    async def _advance(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            t, _, kind, args = heapq.heappop(self._timers)
            if kind == "prefilled":
                await self._prefilled(t, *args)
            else:
                w, ids, out_blocks = args
                w.cache.unpin(ids)
                w.cache.private_blocks -= out_blocks
                w.decode_ends.remove(t)
                heapq.heapify(w.decode_ends)

    async def _prefilled(self, t: float, w: SimWorker, r: TraceRequest, hit: int) -> None:
        """The prompt's KV is cached; the same worker decodes, holding it meanwhile."""
        await self._publish(w, *w.cache.store(r.hash_ids))
        if self.kvstore is not None:  # the held blocks, written behind the request
            await self._publish_kvstore(*self.kvstore.put(r.hash_ids))
        w.cache.unpin(r.hash_ids[:hit])
        w.cache.pin(r.hash_ids)
        out_blocks = math.ceil(r.output_length / TRACE_BLOCK_SIZE)
        w.cache.private_blocks += out_blocks
        await self._publish(w, [], w.cache.evict_overflow())
        end = t + r.output_length * self.tm.decode_s_per_token
        w.busy_s += r.output_length * self.tm.decode_s_per_token / self.tm.decode_batch
        heapq.heappush(w.decode_ends, end)
        self._at(end, "decoded", w, r.hash_ids, out_blocks)

    async def run(self) -> dict:
        for w in self.workers.values():
            await self.events.reset(w.worker_id)  # what registering does
        if self.kvstore is not None:
            await self.events.reset(KVSTORE_ID)
        ttfts: list[float] = []
        hit_blocks = gpu_hit_blocks = total_blocks = 0
        for r in self.trace:
            now = r.arrival_s
            await self._advance(now)
            hits = await self.index.longest_prefix(r.hash_ids)
            req = RouteInput(r.input_length, TRACE_BLOCK_SIZE, len(r.hash_ids), hits)
            cands = [Candidate(w.worker_id, w.role, w.load(now, self.tm)) for w in self.workers.values()]
            plan = self.policy.choose(req, cands)
            # Every worker is a decode worker, so each plan prefills locally.
            p = self.workers[plan.decode_worker]
            hit = p.cache.prefix_len(r.hash_ids)
            p.cache.pin(r.hash_ids[:hit])
            fetched = 0
            if self.kvstore is not None:  # fetch_prefix_from_kvstore: what the store has beyond
                fetched = max(0, self.kvstore.prefix_len(r.hash_ids) - hit)
                self.kvstore.get(r.hash_ids[hit : hit + fetched])
            cached = min(r.input_length, (hit + fetched) * TRACE_BLOCK_SIZE)
            new = r.input_length - cached
            duration = self.tm.fetch_s(fetched) + self.tm.prefill_s(new, cached)
            start = max(now, p.busy_until)
            p.busy_until = start + duration
            p.busy_s += duration
            if start > now:
                heapq.heappush(p.prefill_starts, start)
            self._at(p.busy_until, "prefilled", p, r, hit)
            ttfts.append(p.busy_until - now)
            gpu_hit_blocks += hit
            hit_blocks += hit + fetched
            total_blocks += len(r.hash_ids)
        busy = [w.busy_s for w in self.workers.values()]
        return {
            "hit_rate": hit_blocks / total_blocks if total_blocks else 0.0,
            "gpu_hit_rate": gpu_hit_blocks / total_blocks if total_blocks else 0.0,
            "max_mean_load": max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0,
            "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else 0.0,
            "ttft_p90_s": percentile(ttfts, 90),
        }


POLICIES = {
    "router": CacheAwarePolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
}


def shared_lru_hit_rate(trace: list[TraceRequest], capacity_blocks: int) -> float:
    """Hit rate of ONE LRU cache as big as all workers' together: a reference for what
    placement can reach when the cluster's memory is LRU caches (perfect stickiness, no
    duplicated blocks)."""
    cache = LRUKVCache(capacity_blocks)
    hit = total = 0
    for r in trace:
        hit += cache.prefix_len(r.hash_ids)
        total += len(r.hash_ids)
        cache.store(r.hash_ids)
    return hit / total if total else 0.0


async def run_policies(args: argparse.Namespace, trace: list[TraceRequest], kvstore_capacity_tokens: int) -> dict:
    tm = TimeModel(prefill_tokens_per_s=args.prefill_tokens_per_s)
    results: dict = {}
    for name, make in POLICIES.items():
        sim = Simulation(trace, make(), args.workers, args.capacity_tokens, tm, kvstore_capacity_tokens)
        results[name] = await sim.run()
    return results


async def run_all(args: argparse.Namespace, trace: list[TraceRequest]) -> dict:
    results = await run_policies(args, trace, args.kvstore_capacity_tokens)
    if args.kvstore_capacity_tokens > 0:
        results["gpu_only"] = await run_policies(args, trace, 0)
    results["ideal_hit_rate"] = ideal_hit_rate(trace)
    cluster_blocks = args.workers * (args.capacity_tokens // TRACE_BLOCK_SIZE)
    results["shared_lru_hit_rate"] = shared_lru_hit_rate(trace, cluster_blocks)
    return results


def print_policies(title: str, results: dict) -> None:
    anchor = results["least_loaded"]["ttft_mean_s"]
    print(title)
    headers = [
        "policy",
        "hit_rate",
        "gpu_hit_rate",
        "max/mean load",
        "ttft_mean_s",
        "ttft_p90_s",
        "ttft/least_loaded",
    ]
    rows = []
    for name in POLICIES:
        r = results[name]
        ratio = r["ttft_mean_s"] / anchor
        rows.append(
            cells(
                [
                    name,
                    r["hit_rate"],
                    r["gpu_hit_rate"],
                    r["max_mean_load"],
                    r["ttft_mean_s"],
                    r["ttft_p90_s"],
                    ratio,
                ]
            )
        )
    print_table(headers, rows)
    router = results["router"]
    print(
        f"goals: hit_rate>=0.30 {'ok' if router['hit_rate'] >= 0.30 else 'MISSED'}; "
        f"max/mean load<=1.25 {'ok' if router['max_mean_load'] <= 1.25 else 'MISSED'}; "
        f"ttft<=0.5x least_loaded {'ok' if router['ttft_mean_s'] <= 0.5 * anchor else 'MISSED'}"
    )
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, help="Mooncake-format JSONL")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=TimeModel.prefill_tokens_per_s,
        help="worker prefill speed: sets how loaded the cluster is",
    )
    ap.add_argument("--capacity-tokens", type=int, default=1_000_000, help="KV cache per worker")
    ap.add_argument(
        "--kvstore-capacity-tokens",
        type=int,
        default=32_000_000,
        help="the cluster's kvstore (RAM + disk), in tokens; 0: no kvstore",
    )
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    trace = load_trace(args.trace, args.limit)
    results = asyncio.run(run_all(args, trace))
    print(
        f"trace={args.trace} requests={len(trace)} workers={args.workers} "
        f"capacity={args.capacity_tokens} tokens/worker "
        f"kvstore={args.kvstore_capacity_tokens} tokens "
        f"prefill={args.prefill_tokens_per_s:.0f} tokens/s\n"
    )
    if args.kvstore_capacity_tokens > 0:
        print_policies(f"GPU caches + kvstore ({args.kvstore_capacity_tokens} tokens):", results)
        print_policies("GPU caches only (json: gpu_only):", results["gpu_only"])
    else:
        print_policies("GPU caches only:", results)
    print(f"ideal hit rate (infinite shared cache): {results['ideal_hit_rate']:.3f}")
    print(
        "one LRU as big as all workers' GPU caches (reference for perfect placement): "
        f"{results['shared_lru_hit_rate']:.3f}"
    )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
