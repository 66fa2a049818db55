"""Speculation end to end in the engine: the output never changes, and drafts get accepted.

Checkpoints are written by transformers (random init). The qwen3 one copies
from its prompt, so prompt lookup alone drafts well on a repetitive prompt;
the llama one never repeats itself, so only what finished requests taught
the shared suffix index can draft for it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter
from kvmesh.speculation.local import LocalProposer
from tests.engine.conftest import PROMPTS, write_checkpoint
from tests.service_helpers import free_port

from .conftest import connected, eventually, proposer_for, server_stats, speculator_on

REPETITIVE = [7, 8, 9, 10] * 8
BATCH = [REPETITIVE, *PROMPTS]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-ckpt")
    return {arch: write_checkpoint(root / arch, arch) for arch in ("qwen3-qknorm-tied", "llama-gqa")}


def reference(path: Path) -> list[list[int]]:
    return [c.token_ids for c in LLMEngine(path, EngineConfig(num_blocks=128)).generate(BATCH, GREEDY)]


def speculating(path: Path, proposer) -> LLMEngine:
    return LLMEngine(path, EngineConfig(num_blocks=128), drafter=Drafter(proposer, 4))


def test_prompt_lookup_on_a_repetitive_prompt_keeps_greedy_output_identical(checkpoints):
    path = checkpoints["qwen3-qknorm-tied"]
    engine = speculating(path, LocalProposer())
    assert [c.token_ids for c in engine.generate(BATCH, GREEDY)] == reference(path)
    assert engine.stats.draft_tokens_accepted > 0
    assert engine.blocks.num_free == 128


def test_a_repeated_request_drafts_from_what_the_first_one_taught(checkpoints):
    path = checkpoints["llama-gqa"]
    expected = reference(path)
    proposer = LocalProposer()
    engine = speculating(path, proposer)
    assert [c.token_ids for c in engine.generate(BATCH, GREEDY)] == expected
    first_steps = engine.stats.steps
    assert engine.stats.draft_tokens_accepted == 0  # this model never repeats itself
    assert proposer.speculator.stats().indexed_sequences == len(BATCH)

    assert [c.token_ids for c in engine.generate(BATCH, GREEDY)] == expected
    assert engine.stats.draft_tokens_accepted > 0
    assert engine.stats.steps - first_steps < first_steps
    assert proposer.speculator.stats().active_requests == 0


async def test_through_the_speculator_service(checkpoints):
    """The decode worker's wiring: AsyncEngine's thread calls SpeculatorProposer, the stream
    runs on this loop, the speculator service learns across requests."""
    path = checkpoints["llama-gqa"]
    expected = await asyncio.to_thread(reference, path)
    port = free_port()
    async with speculator_on(port), proposer_for(port) as (proposer, registry):
        await connected(proposer)
        engine = await asyncio.to_thread(speculating, path, proposer)
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            for round_ in range(2):
                outputs = await asyncio.gather(
                    *(_collect(aengine, prompt, f"{round_}-{i}") for i, prompt in enumerate(BATCH))
                )
                assert outputs == expected
                learned = sum(len(p) + len(o) for p, o in zip(BATCH, expected))

                async def taught() -> bool:
                    st = await server_stats(port)
                    return st.indexed_tokens == learned and st.active_requests == 0

                await eventually(taught)
        finally:
            await asyncio.to_thread(aengine.stop)
        assert engine.stats.draft_tokens_accepted > 0
        # The speculator's acceptance count is exactly what the engine verified.
        assert (await server_stats(port)).accepted_tokens == engine.stats.draft_tokens_accepted
        assert registry.get_sample_value("kvmesh_speculator_client_late_updates_total") == 0


async def _collect(aengine: AsyncEngine, prompt: list[int], request_id: str) -> list[int]:
    tokens: list[int] = []
    async for out in aengine.generate(prompt, GREEDY, request_id):
        tokens += out.new_token_ids
    return tokens
