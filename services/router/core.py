"""The router core: where a request runs, from the prefix index and the workers' load.

Any replica can answer any call: the index and registry are shared in Redis (``shared_state``), workers
keep them current (``membership``). Each replica keeps only what is safe to lose: the registry mirror and
the tokens it routed to each worker since that worker's last heartbeat, so a burst between heartbeats does
not all land on the same worker. With Redis down, routing goes on over the mirror using load alone
(``counters["routes_load_only"]`` counts).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import structlog

from kvmesh.blocks import BlockHash, block_hashes
from kvmesh.errors import NotFound, Unavailable

from .events import KVEventApplier
from .index import PrefixHits, PrefixIndex
from .membership import Membership
from .policy import CacheAwarePolicy, Candidate, Policy, RouteInput, RoutePlan
from .redis_store import StoreUnavailable
from .registry import WorkerRegistry
from .registry_store import RegistryStore

log = structlog.get_logger()

# Hash prompts longer than this off the event loop: a long one's hashing would hold it (docs/measurements.md).
_HASH_INLINE_MAX_BLOCKS = 256


class Router(Membership):
    def __init__(
        self,
        index: PrefixIndex,
        registry: WorkerRegistry,
        store: RegistryStore,
        policy: Policy | None = None,
        *,
        now: Callable[[], float] = time.time,
        pull_interval_s: float = 0.05,
        probe_interval_s: float = 1.0,
    ) -> None:
        self.index = index
        self.registry = registry
        self.store = store
        self.policy = policy or CacheAwarePolicy()
        self.events = KVEventApplier(index)
        self._now = now
        self._pull_interval_s = pull_interval_s
        self._probe_interval_s = probe_interval_s
        self._last_pull = -float("inf")
        self._next_probe = 0.0
        self._needs_resync: set[str] = set()
        self._dropped_while_down: set[str] = set()
        # worker -> [(routed at, tokens)]: work sent since its last heartbeat.
        self._pending: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self.redis_available = True
        self.counters: Counter[str] = Counter()

    # -- routing ------------------------------------------------------------

    async def route(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: bytes = b"",
        max_new_tokens: int = 0,
        exclude: Collection[str] = (),
        request_id: str = "",
        adapter: str = "",
    ) -> RoutePlan:
        """Plan a request from its prompt tokens, hashed into the cluster's blocks (under ``adapter``'s
        chain when it names a LoRA adapter: only workers that loaded it are candidates)."""
        await self._pull()
        layout = self.registry.cluster_layout
        if layout is None:
            raise Unavailable("no prefill or decode worker has registered yet")
        root = self._adapter_fingerprint(adapter) if adapter else layout.model_fingerprint
        args = (token_ids, layout.block_size, root, cache_salt)
        if len(token_ids) // layout.block_size > _HASH_INLINE_MAX_BLOCKS:
            chain = await asyncio.to_thread(block_hashes, *args)
        else:
            chain = block_hashes(*args)
        return await self.route_chain(
            chain,
            num_tokens=len(token_ids),
            block_size=layout.block_size,
            max_new_tokens=max_new_tokens,
            exclude=exclude,
            request_id=request_id,
            adapter=adapter,
            adapter_fingerprint=root if adapter else None,
        )

    async def route_chain(
        self,
        chain: Sequence[BlockHash],
        *,
        num_tokens: int,
        block_size: int,
        max_new_tokens: int = 0,
        exclude: Collection[str] = (),
        request_id: str = "",
        adapter: str = "",
        adapter_fingerprint: bytes | None = None,
    ) -> RoutePlan:
        """Plan a request from a precomputed chain of ``block_size``-token blocks; with ``adapter``,
        among the workers that loaded it (with ``adapter_fingerprint``, from the same files)."""
        await self._maybe_recover()
        await self._pull()
        candidates = self._candidates(exclude)
        if not candidates:
            raise Unavailable("no live prefill or decode worker to route to")
        if adapter:
            candidates = [c for c in candidates if _serves(c, adapter, adapter_fingerprint)]
            if not candidates:
                raise NotFound(f"model {adapter!r} is not served: no live worker has that adapter loaded")
        hits = PrefixHits()
        if self.redis_available:
            try:
                hits = await self.index.longest_prefix(chain)
            except StoreUnavailable as e:
                self._mark_down(e)
        if not self.redis_available:
            self.counters["routes_load_only"] += 1
        live = {c.worker_id for c in candidates}
        # Entries of workers that are gone (or excluded) must not attract requests.
        hits = PrefixHits({w: n for w, n in hits.gpu_blocks.items() if w in live}, hits.kvstore_blocks)
        req = RouteInput(
            num_tokens, block_size, len(chain), hits, index_available=self.redis_available, adapter=adapter or None
        )
        plan = self.policy.choose(req, candidates)
        now = self._now()
        if plan.prefill_locally:
            self._pending[plan.decode_worker].append((now, plan.uncached_tokens + max_new_tokens))
        else:
            self._pending[plan.prefilling_worker].append((now, plan.uncached_tokens))
            self._pending[plan.decode_worker].append((now, max_new_tokens))
        self.counters["routes"] += 1
        log.debug(
            "routed",
            request_id=request_id,
            prefill=plan.prefill_worker,
            decode=plan.decode_worker,
            local=plan.prefill_locally,
            matched=plan.prefill_matched_blocks,
            total=plan.total_blocks,
        )
        return plan

    def _adapter_fingerprint(self, adapter: str) -> bytes:
        """The chain root of ``adapter``: the one most live workers report for it (workers that loaded
        other files under that name are then not candidates). NotFound when no worker has it."""
        roots = Counter(
            a.fingerprint
            for s in self.registry.live()
            if s.info.role.runs_requests and (a := s.load.adapter(adapter)) is not None
        )
        if not roots:
            raise NotFound(f"model {adapter!r} is not served: no live worker has that adapter loaded")
        return roots.most_common(1)[0][0]

    def _candidates(self, exclude: Collection[str]) -> list[Candidate]:
        out = []
        for s in self.registry.live():
            if s.worker_id in exclude or not s.info.role.runs_requests:
                continue
            # Work this replica sent after the worker's last report is not in
            # that report yet; older entries are, so they are dropped.
            pending = [p for p in self._pending.get(s.worker_id, ()) if p[0] >= s.heartbeat_at]
            self._pending[s.worker_id] = pending
            load = replace(
                s.load,
                tokens_in_flight=s.load.tokens_in_flight + sum(t for _, t in pending),
                queued_requests=s.load.queued_requests + len(pending),
            )
            out.append(Candidate(s.worker_id, s.info.role, load))
        return out


def _serves(c: Candidate, adapter: str, fingerprint: bytes | None) -> bool:
    state = c.load.adapter(adapter)
    return state is not None and (fingerprint is None or state.fingerprint == fingerprint)
