"""The routing decision on its own: prefix scoring, load, conditional disaggregation, baselines."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from kvmesh.errors import Unavailable
from services.router.index import PrefixHits
from services.router.policy import (
    CacheAwarePolicy,
    Candidate,
    CostWeights,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    RouteInput,
)
from services.router.worker import Role, WorkerLoad

from .conftest import BLOCK_SIZE, idle


def decode(worker_id: str, load: WorkerLoad | None = None) -> Candidate:
    return Candidate(worker_id, Role.DECODE, load or idle())


def prefill(worker_id: str, load: WorkerLoad | None = None) -> Candidate:
    return Candidate(worker_id, Role.PREFILL, load or idle())


def request(blocks: int, gpu: dict[str, int], kvstore: int = 0) -> RouteInput:
    return RouteInput(blocks * BLOCK_SIZE, BLOCK_SIZE, blocks, PrefixHits(gpu, kvstore))


def test_longest_cached_prefix_wins_among_equally_loaded_workers():
    workers = [decode("a"), decode("b"), decode("c")]
    plan = CacheAwarePolicy().choose(request(400, {"a": 100, "b": 300}), workers)
    assert plan.decode_worker == "b" and plan.prefill_locally
    assert plan.prefill_matched_blocks == plan.decode_matched_blocks == 300
    assert plan.total_blocks == 400
    assert plan.matched_blocks == {"a": 100, "b": 300}
    assert plan.uncached_tokens == 100 * BLOCK_SIZE


def test_a_long_queue_outweighs_a_small_cache_advantage():
    busy = replace(idle(), tokens_in_flight=50_000, queued_requests=5)
    workers = [decode("a", busy), decode("b")]
    plan = CacheAwarePolicy().choose(request(400, {"a": 300, "b": 250}), workers)
    assert plan.decode_worker == "b"


def test_kvstore_hits_make_any_worker_cheap_but_gpu_hits_cheaper():
    workers = [decode("a"), decode("b")]
    plan = CacheAwarePolicy().choose(request(400, {"a": 200}, kvstore=400), workers)
    assert plan.decode_worker == "a"
    assert plan.kvstore_matched_blocks == 400


def test_kv_memory_shortage_steers_away():
    full = WorkerLoad(free_kv_blocks=10, total_kv_blocks=10_000)
    workers = [decode("a", full), decode("b")]
    plan = CacheAwarePolicy().choose(request(400, {"a": 200}), workers)
    assert plan.decode_worker == "b"


def test_load_bounds_piling_onto_the_hot_prefix_holder():
    """Every request shares a long prefix only worker "hot" holds; as its queue
    grows (as heartbeats and the core's pending count report), others take over."""
    policy = CacheAwarePolicy()
    loads = {w: idle() for w in ("hot", "b", "c", "d")}
    chosen = Counter()
    for _ in range(64):
        workers = [decode(w, load) for w, load in loads.items()]
        plan = policy.choose(request(200, {"hot": 150}), workers)
        w = plan.decode_worker
        chosen[w] += 1
        loads[w] = replace(
            loads[w],
            tokens_in_flight=loads[w].tokens_in_flight + plan.uncached_tokens,
            queued_requests=loads[w].queued_requests + 1,
        )
    assert chosen["hot"] >= 16  # the cache is used...
    assert chosen["hot"] < 48  # ...but not for everything
    assert len(chosen) == 4


def test_idle_ties_spread_round_robin():
    policy = CacheAwarePolicy()
    workers = [decode(w) for w in "abcd"]
    picked = [policy.choose(request(10, {}), workers).decode_worker for _ in range(8)]
    assert Counter(picked) == {w: 2 for w in "abcd"}


def test_disaggregates_a_long_uncached_prompt_to_a_prefill_worker():
    workers = [prefill("p1"), prefill("p2"), decode("d1"), decode("d2")]
    plan = CacheAwarePolicy().choose(request(400, {"p2": 100}), workers)
    assert not plan.prefill_locally
    assert plan.prefill_worker == "p2" and plan.prefill_matched_blocks == 100
    assert plan.decode_worker in {"d1", "d2"} and plan.prefilling_worker == "p2"


def test_prefills_locally_when_the_decode_worker_holds_most_of_the_prompt():
    workers = [prefill("p1"), decode("d1"), decode("d2")]
    plan = CacheAwarePolicy().choose(request(400, {"d2": 350, "p1": 100}), workers)
    assert plan.prefill_locally and plan.prefill_worker is None
    assert plan.decode_worker == "d2" and plan.prefilling_worker == "d2"
    assert plan.decode_matched_blocks == plan.prefill_matched_blocks == 350


def test_prefills_locally_when_the_prompt_is_short():
    workers = [prefill("p1"), decode("d1")]
    plan = CacheAwarePolicy().choose(request(10, {}), workers)
    assert plan.prefill_locally and plan.decode_worker == "d1"


def test_local_threshold_is_configurable():
    workers = [prefill("p1"), decode("d1")]
    strict = CacheAwarePolicy(CostWeights(local_max_uncached_tokens=0, local_min_hit_fraction=1.0))
    assert not strict.choose(request(10, {}), workers).prefill_locally


def test_no_decode_worker_is_unavailable():
    with pytest.raises(Unavailable):
        CacheAwarePolicy().choose(request(10, {}), [prefill("p1")])


def test_without_prefix_info_the_policy_is_least_loaded():
    busy = replace(idle(), tokens_in_flight=10_000)
    workers = [decode("a", busy), decode("b"), decode("c", busy)]
    req = RouteInput(160, BLOCK_SIZE, 10, PrefixHits(), index_available=False)
    plan = CacheAwarePolicy().choose(req, workers)
    assert plan.decode_worker == "b" and not plan.index_available


def test_round_robin_takes_turns():
    policy = RoundRobinPolicy()
    workers = [decode(w) for w in "abc"]
    assert [policy.choose(request(4, {}), workers).decode_worker for _ in range(4)] == list("abca")


def test_least_loaded_ignores_the_cache():
    busy = replace(idle(), tokens_in_flight=10)
    workers = [decode("a", busy), decode("b")]
    assert LeastLoadedPolicy().choose(request(40, {"a": 40}), workers).decode_worker == "b"
