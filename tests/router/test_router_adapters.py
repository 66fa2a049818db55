"""Routing requests under LoRA adapters: only workers that loaded the adapter, its own hash chain, a
resident copy preferred until load says otherwise, and a clear NotFound when nobody has it."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from kvmesh.blocks import adapter_fingerprint, block_hashes
from kvmesh.errors import NotFound
from services.router.events import EventKind, KVEvent
from services.router.index import Tier
from services.router.worker import AdapterState, Role

from .conftest import BLOCK_SIZE, LAYOUT, idle, worker

PROMPT = list(range(8 * BLOCK_SIZE))
SQL = adapter_fingerprint(LAYOUT.model_fingerprint, b"sql-files")


async def _register(router, worker_id: str, *adapters: AdapterState, queued: int = 0):
    reg = await router.register(worker(worker_id, Role.DECODE))
    await router.heartbeat(worker_id, reg.lease.lease_id, replace(idle(), adapters=adapters, queued_requests=queued))
    return reg


async def test_only_workers_with_the_adapter_are_picked_and_resident_ones_first(make_router):
    router = make_router()
    await _register(router, "none")
    await _register(router, "loaded", AdapterState("sql", SQL, resident=False))
    await _register(router, "resident", AdapterState("sql", SQL, resident=True))
    picked = Counter([(await router.route(PROMPT, adapter="sql")).decode_worker for _ in range(6)])
    assert "none" not in picked
    assert picked.most_common(1)[0][0] == "resident"
    # The base model's requests go anywhere.
    assert {(await router.route(PROMPT)).decode_worker for _ in range(9)} == {"none", "loaded", "resident"}


async def test_a_busy_resident_worker_spreads_a_hot_adapter(make_router):
    router = make_router()
    await _register(router, "resident", AdapterState("sql", SQL, resident=True), queued=20)
    await _register(router, "loaded", AdapterState("sql", SQL, resident=False))
    assert (await router.route(PROMPT, adapter="sql")).decode_worker == "loaded"


async def test_the_adapter_chain_finds_its_own_cached_blocks(make_router):
    router = make_router()
    reg_a = await _register(router, "a", AdapterState("sql", SQL, resident=True))
    await _register(router, "b", AdapterState("sql", SQL, resident=True))
    under_sql = block_hashes(PROMPT, BLOCK_SIZE, SQL)
    event = KVEvent(EventKind.STORED, Tier.GPU, under_sql[:6])
    await router.publish_kv_events("a", reg_a.lease.lease_id, 1, [event])
    plan = await router.route(PROMPT, adapter="sql")
    assert plan.decode_worker == "a" and plan.matched_blocks == {"a": 6}
    assert (await router.route(PROMPT)).matched_blocks == {}  # the base model's chain holds none of them


async def test_unknown_adapter_and_other_files_under_the_name(make_router):
    router = make_router()
    await _register(router, "a", AdapterState("sql", SQL, resident=True))
    await _register(router, "b", AdapterState("sql", SQL, resident=True))
    await _register(router, "odd", AdapterState("sql", b"other-files", resident=True))
    assert {(await router.route(PROMPT, adapter="sql")).decode_worker for _ in range(9)} == {"a", "b"}
    with pytest.raises(NotFound, match="model 'chat' is not served: no live worker has that adapter loaded"):
        await router.route(PROMPT, adapter="chat")
