"""Prefix reuse, preemption under a tiny pool, cancellation, KV export/import."""

from __future__ import annotations

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams

from .conftest import PROMPTS
from .hf_reference import hf_greedy

BS = 16


def _greedy(n: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_second_request_with_shared_prefix_computes_only_new_tokens(checkpoints):
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64))
    prefix = list(range(100, 100 + 3 * BS))  # exactly three full blocks
    first = engine.generate([prefix + [7, 8, 9]], _greedy(1))[0]
    assert first.num_cached_tokens == 0
    before = engine.stats.computed_tokens
    second = engine.generate([prefix + [20, 21, 22, 23, 24]], _greedy(1))[0]
    assert second.num_cached_tokens == 3 * BS
    assert engine.stats.computed_tokens - before == 5  # only the new tokens ran
    assert engine.stats.cached_prompt_tokens == 3 * BS


def test_cache_salt_isolates_tenants(checkpoints):
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64))
    prompt = list(range(100, 100 + 3 * BS)) + [5]
    engine.add_request(prompt, _greedy(1), cache_salt=b"tenant-a")
    while engine.has_unfinished():
        engine.step()
    engine.add_request(prompt, _greedy(1), cache_salt=b"tenant-b")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 0


def test_pool_too_small_preempts_and_still_matches(checkpoints):
    path = checkpoints["llama-gqa"]
    # 4 prompts x (up to 50 + 32 tokens) need ~16 blocks at once; give 9.
    engine = LLMEngine(path, EngineConfig(num_blocks=9, max_num_batched_tokens=64))
    results = engine.generate(PROMPTS, _greedy(32))
    assert engine.stats.preemptions > 0
    for prompt, res in zip(PROMPTS, results):
        assert res.token_ids == hf_greedy(path, prompt, 32)[0]
    assert engine.blocks.num_free == 9  # nothing leaked


def test_abort_frees_blocks_at_once(checkpoints):
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=32, enable_prefix_cache=False))
    rid = engine.add_request(list(range(1, 60)), _greedy(100))
    engine.step()
    assert engine.blocks.num_free < 32
    engine.abort(rid)
    assert engine.blocks.num_free == 32
    assert not engine.has_unfinished()


def test_exported_blocks_import_into_another_engine(checkpoints):
    """The prefill->decode hand-off in miniature: B imports A's blocks and skips computing them."""
    path = checkpoints["qwen3-qknorm-tied"]
    prompt = list(range(200, 200 + 3 * BS + 5))
    a = LLMEngine(path, EngineConfig(num_blocks=32))
    expected = a.generate([prompt], _greedy(16))[0].token_ids
    hashes = a.prompt_block_hashes(prompt)
    assert len(hashes) == 3
    exported = a.export_blocks(hashes)
    assert len(exported) == 3

    b = LLMEngine(path, EngineConfig(num_blocks=32))
    assert b.fingerprint == a.fingerprint
    for h, payload in exported:
        assert b.import_block(h, payload)
    got = b.generate([prompt], _greedy(16))[0]
    assert got.num_cached_tokens == 3 * BS
    assert b.stats.computed_tokens == 5 + 15  # the partial block, then one per decode step
    assert got.token_ids == expected


def test_held_prompt_blocks_survive_pressure_until_released(checkpoints):
    """A prefill worker's lease: the prompt's blocks stay exportable until released."""
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=8))
    prompt = list(range(1, 1 + 2 * BS + 3))
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), "held", hold_prompt_blocks=True)
    while engine.has_unfinished():
        engine.step()
    hashes = engine.held_hashes("held")
    assert hashes == engine.prompt_block_hashes(prompt)
    # Pressure: another request needs every free block; the held two must not be evicted.
    engine.generate([list(range(200, 200 + 5 * BS))], _greedy(BS))
    exported = engine.export_held("held", hashes[::-1])
    assert [h for h, _ in exported] == hashes[::-1]
    assert engine.release_held("held") == 2
    assert engine.release_held("held") == 0
    assert engine.blocks.num_free == 8
