"""The prefix index, the same expectations for Redis and in memory."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument
from services.router.index import InMemoryPrefixIndex, RedisPrefixIndex, Tier
from services.router.redis_store import connect

from .conftest import chain


@pytest.fixture(params=["memory", "redis"])
async def index(request):
    if request.param == "memory":
        yield InMemoryPrefixIndex()
        return
    server = request.getfixturevalue("redis_server")
    client = connect(server.url)
    yield RedisPrefixIndex(client, write_batch_blocks=64)  # small batches: exercise the loops
    await client.aclose()


async def test_each_worker_gets_its_leading_gpu_blocks(index):
    c = chain(100)
    await index.add("a", Tier.GPU, c[:30])
    await index.add("b", Tier.GPU, c[:80])
    await index.add("c", Tier.GPU, c[50:])  # no first block: no prefix
    await index.add("d", Tier.GPU, c[:10] + c[11:90])  # a hole at block 10
    hits = await index.longest_prefix(c)
    assert hits.gpu_blocks == {"a": 30, "b": 80, "d": 10}
    assert hits.kvstore_blocks == 0
    assert (await index.longest_prefix(chain(5, salt=b"other tenant"))).gpu_blocks == {}
    assert (await index.longest_prefix([])).gpu_blocks == {}


async def test_kvstore_tier_is_one_cluster_wide_prefix(index):
    c = chain(40)
    await index.add("a", Tier.KVSTORE, c[:10])
    await index.add("b", Tier.KVSTORE, c[10:25])
    await index.add("a", Tier.GPU, c[:5])
    hits = await index.longest_prefix(c)
    assert hits.kvstore_blocks == 25
    assert hits.gpu_blocks == {"a": 5}


async def test_remove_clear_and_drop(index):
    c = chain(20)
    await index.add("a", Tier.GPU, c)
    await index.add("a", Tier.KVSTORE, c)
    await index.add("b", Tier.GPU, c[:15])
    await index.remove("a", Tier.GPU, c[12:14])
    assert (await index.longest_prefix(c)).gpu_blocks == {"a": 12, "b": 15}
    assert await index.indexed_blocks("a") == 38
    await index.clear("a", Tier.GPU)
    hits = await index.longest_prefix(c)
    assert hits.gpu_blocks == {"b": 15} and hits.kvstore_blocks == 20
    await index.set_last_seq("a", 7)
    await index.drop_worker("a")
    assert await index.indexed_blocks("a") == 0
    assert await index.last_seq("a") is None
    assert (await index.longest_prefix(c)).kvstore_blocks == 0
    assert (await index.longest_prefix(c)).gpu_blocks == {"b": 15}


async def test_a_freed_slot_never_carries_a_dropped_workers_blocks(redis_server):
    client = connect(redis_server.url)
    index = RedisPrefixIndex(client)
    c = chain(10)
    await index.add("old", Tier.GPU, c)
    await index.drop_worker("old")
    await index.add("new", Tier.GPU, c[:3])  # takes the freed slot
    assert (await index.longest_prefix(c)).gpu_blocks == {"new": 3}
    assert await client.dbsize() > 0
    await index.drop_worker("new")
    assert await client.dbsize() == 0  # nothing left behind
    await client.aclose()


async def test_redis_rejects_hashes_that_are_not_block_names(redis_server):
    client = connect(redis_server.url)
    with pytest.raises(InvalidArgument):
        await RedisPrefixIndex(client).add("a", Tier.GPU, [b"short"])
    await client.aclose()


async def test_longest_prefix_of_a_12500_block_chain_in_one_call(redis_server):
    """A 200,000-token prompt: 12,500 blocks, eight workers holding various prefixes."""
    client = connect(redis_server.url)
    index = RedisPrefixIndex(client)
    c = chain(12_500)
    held = {"w0": 12_500, "w1": 9_000, "w2": 4_321, "w3": 1, "w4": 12_499}
    for w, n in held.items():
        await index.add(w, Tier.GPU, c[:n])
    await index.add("w5", Tier.GPU, c[:6_000] + c[6_001:])  # hole at 6,000
    await index.add("w6", Tier.KVSTORE, c[:11_000])
    await index.add("w7", Tier.GPU, c[1:])  # everything but the first block
    await client.config_resetstat()
    hits = await index.longest_prefix(c)
    assert hits.gpu_blocks == {**held, "w5": 6_000}
    assert hits.kvstore_blocks == 11_000
    evalsha = (await client.info("commandstats"))["cmdstat_evalsha"]
    # One round trip (plus, the first time, a NOSCRIPT answer that loads the script).
    assert evalsha["calls"] - evalsha["failed_calls"] == 1
    await client.aclose()
