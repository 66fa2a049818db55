"""The routing decision: pure, synchronous, and the same for the service and the trace simulation.

Costs are in *token-equivalents of prefill work* so that cache hits and load
are weighed on one scale:

- prefill cost on worker w = its queue (tokens in flight, plus a fixed cost
  per queued request and per running sequence) + ``recompute_cost`` x the
  prompt tokens w would still have to compute (what its GPU cache and the
  kvstore do not cover; a kvstore block costs a fraction of recomputing it)
  + a KV-memory pressure term. With ``recompute_cost`` = 1 this is "when would
  w produce my first token"; it is larger because recomputing a prefix the
  cluster already holds also delays every later request queued behind it, a
  cost the request's own TTFT does not see. Either way a worker holding a
  popular prefix wins only until its queue outweighs the work it saves: load
  bounds piling onto hot prefixes by construction.
- decode cost on worker d = its running sequences + KV-memory pressure.
- moving KV from a prefill worker to the decode worker costs a small amount
  per token the decode worker lacks.

Conditional disaggregation: the decode worker prefills locally when it
already holds most of the prompt or what is left to compute is short (both
thresholds configurable); otherwise the cheapest prefill worker computes it
and ships the KV. A cluster with no prefill-role workers always prefills
locally.

``RoundRobinPolicy`` and ``LeastLoadedPolicy`` are the baselines the trace
benchmark compares against; they share the interface.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.errors import Unavailable

from .index import PrefixHits
from .worker import Role, WorkerLoad


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    role: Role
    load: WorkerLoad


@dataclass(frozen=True)
class RouteInput:
    # Prompt length in tokens, including a trailing partial block.
    num_tokens: int
    # Tokens per block of this chain (the engine's 16, or the trace's 512).
    block_size: int
    # Blocks in the chain (full blocks; the trace also names its partial one).
    total_blocks: int
    # What the index knows; empty when it is unavailable.
    hits: PrefixHits = field(default_factory=PrefixHits)
    # False when the index could not be read (the plan then rests on load alone).
    index_available: bool = True
    # The LoRA adapter it runs under (None: the base model); every candidate has it loaded.
    adapter: str | None = None


@dataclass(frozen=True)
class RoutePlan:
    # None when the decode worker prefills locally.
    prefill_worker: str | None
    decode_worker: str
    prefill_locally: bool
    total_blocks: int
    # Leading blocks already on the GPU of the worker that prefills / decodes.
    prefill_matched_blocks: int
    decode_matched_blocks: int
    kvstore_matched_blocks: int
    # Every worker's GPU prefix for this chain (as the index saw it).
    matched_blocks: dict[str, int]
    # Tokens the prefilling worker still has to compute (or fetch from the kvstore).
    uncached_tokens: int
    # The rest of the prompt: what the prefilling worker should find cached (its GPU, the kvstore).
    predicted_cached_tokens: int
    index_available: bool

    @property
    def prefilling_worker(self) -> str:
        return self.decode_worker if self.prefill_worker is None else self.prefill_worker


class Policy(Protocol):
    def choose(self, req: RouteInput, workers: Sequence[Candidate]) -> RoutePlan: ...


@dataclass(frozen=True)
class CostWeights:
    # Conditional disaggregation: prefill on the decode worker when at most this
    # many prompt tokens are left to compute there...
    local_max_uncached_tokens: int = 1024
    # ...or when it already holds at least this fraction of the prompt's blocks.
    local_min_hit_fraction: float = 0.8
    # Weight of prompt tokens to compute against queued tokens (see module doc;
    # 4 gave the lowest mean TTFT in bench/router_trace.py's sweep of 1..16).
    recompute_cost: float = 4.0
    # Fixed cost of each queued request (scheduling, sampling, a pass's overhead).
    request_overhead_tokens: int = 128
    # What one running sequence costs a worker (its decode steps share the GPU).
    active_seq_tokens: int = 64
    # Fetching a block from the kvstore, relative to recomputing it.
    kvstore_fetch_cost: float = 0.1
    # Moving one token's KV from the prefill worker to the decode worker.
    transfer_cost: float = 0.05
    # Per token of KV that would not fit in the worker's free blocks.
    kv_shortage_cost: float = 4.0
    # Serving a LoRA adapter that is loaded but not resident in a slot: copying it in (and
    # possibly waiting for a slot) costs about this much, so a resident worker wins until its
    # queue outweighs it and a hot adapter then spreads.
    adapter_swap_tokens: int = 256


def split_roles(workers: Sequence[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(prefill-role workers, decode-role workers); Unavailable when nobody can decode."""
    prefill = [w for w in workers if w.role is Role.PREFILL]
    decode = [w for w in workers if w.role is Role.DECODE]
    if not decode:
        raise Unavailable("no decode worker is registered")
    return prefill, decode


def _rotated(workers: list[Candidate], turn: int) -> list[Candidate]:
    """The list started at ``turn``: ``min`` then breaks exact ties (an idle cluster,
    a prefix every worker holds) round-robin instead of always picking the first."""
    k = turn % len(workers)
    return workers[k:] + workers[:k]


def _plan(req: RouteInput, prefill: str | None, decode: str, uncached: int) -> RoutePlan:
    gpu = req.hits.gpu_blocks
    return RoutePlan(
        prefill_worker=prefill,
        decode_worker=decode,
        prefill_locally=prefill is None,
        total_blocks=req.total_blocks,
        prefill_matched_blocks=gpu.get(prefill or decode, 0),
        decode_matched_blocks=gpu.get(decode, 0),
        kvstore_matched_blocks=req.hits.kvstore_blocks,
        matched_blocks=dict(gpu),
        uncached_tokens=uncached,
        predicted_cached_tokens=req.num_tokens - uncached,
        index_available=req.index_available,
    )


class CacheAwarePolicy:
    """The router's policy: cheapest plan by cached prefix against load (see module doc)."""

    def __init__(self, weights: CostWeights | None = None) -> None:
        self.w = weights or CostWeights()
        self._turn = itertools.count()

    def _queue(self, load: WorkerLoad) -> float:
        return (
            load.tokens_in_flight
            + load.queued_requests * self.w.request_overhead_tokens
            + load.active_sequences * self.w.active_seq_tokens
        )

    def _work(self, req: RouteInput, worker_id: str) -> tuple[int, float]:
        """(tokens not on the worker's GPU, their cost counting kvstore fetches as cheap)."""
        # A worker never reuses the block holding the prompt's last token: that token must run through the
        # model for the first token's logits (the engine's scheduler), so a fully cached prompt still computes it.
        usable = max(req.num_tokens - 1, 0) // req.block_size
        gpu = min(req.hits.gpu_blocks.get(worker_id, 0), usable) * req.block_size
        stored = min(req.hits.kvstore_blocks, usable) * req.block_size
        fetched = max(0, stored - gpu)
        missing = req.num_tokens - gpu
        return missing, (missing - fetched) + fetched * self.w.kvstore_fetch_cost

    def _kv_shortage(self, req: RouteInput, c: Candidate) -> float:
        if c.load.total_kv_blocks <= 0:
            return 0.0
        needed = req.total_blocks - req.hits.gpu_blocks.get(c.worker_id, 0)
        short_blocks = max(0, needed - c.load.free_kv_blocks)
        return short_blocks * req.block_size * self.w.kv_shortage_cost

    def _adapter_swap(self, req: RouteInput, c: Candidate) -> float:
        if req.adapter is None:
            return 0.0
        state = c.load.adapter(req.adapter)
        return 0.0 if state is not None and state.resident else self.w.adapter_swap_tokens

    def _prefill_cost(self, req: RouteInput, c: Candidate) -> float:
        work = self._work(req, c.worker_id)[1] * self.w.recompute_cost
        return self._queue(c.load) + work + self._kv_shortage(req, c) + self._adapter_swap(req, c)

    def _decode_cost(self, req: RouteInput, c: Candidate) -> float:
        swap = self._adapter_swap(req, c)
        return c.load.active_sequences * self.w.active_seq_tokens + self._kv_shortage(req, c) + swap

    def _prefers_local(self, req: RouteInput, d: Candidate) -> bool:
        missing, _ = self._work(req, d.worker_id)
        held = req.hits.gpu_blocks.get(d.worker_id, 0)
        return missing <= self.w.local_max_uncached_tokens or held >= self.w.local_min_hit_fraction * req.total_blocks

    def choose(self, req: RouteInput, workers: Sequence[Candidate]) -> RoutePlan:
        prefill, decode = split_roles(workers)
        turn = next(self._turn)
        best_remote = None
        if prefill:
            best_remote = min(_rotated(prefill, turn), key=lambda p: self._prefill_cost(req, p))
        best: tuple[float, Candidate | None, Candidate] | None = None
        for d in _rotated(decode, turn):
            base = self._decode_cost(req, d)
            if best_remote is None or self._prefers_local(req, d):
                option = (base + self._prefill_cost(req, d), None, d)
            else:
                lacking = self._work(req, d.worker_id)[0]
                cost = base + self._prefill_cost(req, best_remote) + lacking * self.w.transfer_cost
                option = (cost, best_remote, d)
            if best is None or option[0] < best[0]:
                best = option
        assert best is not None
        _, p, d = best
        uncached = self._work(req, (p or d).worker_id)[0]
        return _plan(req, p.worker_id if p else None, d.worker_id, uncached)


def _load_score(load: WorkerLoad) -> tuple[int, int, int]:
    return (load.tokens_in_flight, load.queued_requests, load.active_sequences)


class LeastLoadedPolicy:
    """Baseline: the least-loaded decode worker (and prefill worker, if any), ignoring the cache."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, req: RouteInput, workers: Sequence[Candidate]) -> RoutePlan:
        prefill, decode = split_roles(workers)
        turn = next(self._turn)
        d = min(_rotated(decode, turn), key=lambda c: _load_score(c.load))
        p = min(_rotated(prefill, turn), key=lambda c: _load_score(c.load)) if prefill else None
        return _plan(req, p.worker_id if p else None, d.worker_id, req.num_tokens)


class RoundRobinPolicy:
    """Baseline: take turns, ignoring both the cache and load."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, req: RouteInput, workers: Sequence[Candidate]) -> RoutePlan:
        prefill, decode = split_roles(workers)
        turn = next(self._turn)
        d = decode[turn % len(decode)]
        p = prefill[turn % len(prefill)] if prefill else None
        return _plan(req, p.worker_id if p else None, d.worker_id, req.num_tokens)
