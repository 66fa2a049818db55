"""A failure that belongs to one request fails that request alone; one that no request owns fails them all
with UNAVAILABLE and tells the service (which stops serving and exits)."""

from __future__ import annotations

import asyncio

import pytest

import kvmesh.engine.engine as engine_module
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.grammar import Masks
from kvmesh.errors import InvalidArgument, RequestFailed, Unavailable
from kvmesh.sampling import SamplingParams
from kvmesh.structured.spec import GrammarSpec

from .conftest import PROMPTS

POISONED_SEED = 666  # the request whose sampling the tests make fail


def _params(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(**({"temperature": 0.0, "max_tokens": n, "ignore_eos": True} | kw))


def _poison_sampling(monkeypatch) -> None:
    real = engine_module.verify

    def verify(rows, drafts, params, *args, **kwargs):
        if params.seed == POISONED_SEED:
            raise FloatingPointError("probability tensor contains either inf, nan or element < 0")
        return real(rows, drafts, params, *args, **kwargs)

    monkeypatch.setattr(engine_module, "verify", verify)


def _run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, list]:
    rids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    outs: dict[str, list] = {r: [] for r in rids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def test_a_request_whose_sampling_fails_fails_alone_and_frees_its_blocks(checkpoints, monkeypatch):
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64, enable_prefix_cache=False))
    expected = [c.token_ids for c in engine.generate(PROMPTS[:3], _params())]
    _poison_sampling(monkeypatch)

    outs = _run(engine, [_params(), _params(seed=POISONED_SEED), _params(), _params()])

    failed = [rid for rid, o in outs.items() if o[-1].finish_reason == "error"]
    assert len(failed) == 1
    last = outs[failed[0]][-1]
    assert isinstance(last.error, RequestFailed) and "FloatingPointError" in last.error.message
    survivors = [[t for o in out for t in o.new_token_ids] for rid, out in outs.items() if rid not in failed]
    assert survivors[:1] == expected[:1] and survivors[1] == expected[2]
    assert engine.blocks.num_free == 64 and not engine.has_unfinished()
    assert engine.stats.failed_requests == 1


def test_a_grammar_mask_that_cannot_be_filled_fails_its_request_alone(llama_with_tokenizer, monkeypatch):
    engine = LLMEngine(llama_with_tokenizer, EngineConfig(num_blocks=64))
    real_fill = Masks.fill

    def fill(self, rows):
        if rows.first_row == 0:
            raise RuntimeError("xgrammar: matcher in a bad state")
        return real_fill(self, rows)

    monkeypatch.setattr(Masks, "fill", fill)
    constrained = _params(grammar=GrammarSpec.json_schema({"type": "object"}))
    outs = _run(engine, [constrained, _params()])
    reasons = [o[-1].finish_reason for o in outs.values()]
    assert reasons == ["error", "length"]
    assert "bad state" in next(iter(outs.values()))[-1].error.message


async def test_the_async_engine_raises_a_requests_failure_in_its_caller_only(checkpoints, monkeypatch):
    _poison_sampling(monkeypatch)
    ae = AsyncEngine(LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64)))
    ae.start()
    try:

        async def collect(prompt, params, rid):
            return [t async for out in ae.generate(prompt, params, rid) for t in out.new_token_ids]

        good, bad = await asyncio.gather(
            collect(PROMPTS[0], _params(), "good"),
            collect(PROMPTS[1], _params(seed=POISONED_SEED), "bad"),
            return_exceptions=True,
        )
        assert len(good) == 12
        assert isinstance(bad, RequestFailed)
        assert await collect(PROMPTS[2], _params(4), "after") and not ae._fatal
    finally:
        ae.stop()


async def test_a_failure_no_request_owns_fails_every_stream_unavailable_and_tells_the_service(checkpoints):
    told: list[str] = []
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64, fault_after_steps=5))
    ae = AsyncEngine(engine, on_fatal=told.append)
    ae.start()
    try:
        results = await asyncio.gather(
            *(_drain(ae, PROMPTS[i], f"r{i}") for i in range(3)),
            return_exceptions=True,
        )
        assert all(isinstance(r, Unavailable) for r in results), results
        assert len(told) == 1 and "injected engine fault after 5 steps" in told[0]
        with pytest.raises(Unavailable, match="restarting"):
            await ae.call(lambda e: e.num_running)
    finally:
        ae.stop()


async def _drain(ae: AsyncEngine, prompt: list[int], rid: str) -> None:
    async for _ in ae.generate(prompt, _params(40), rid):
        pass


def test_a_request_id_that_still_holds_a_hand_off_is_not_taken_again(checkpoints):
    """A second request under the id would overwrite the first's hold on its blocks, which then leak."""
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64))
    engine.add_request(PROMPTS[0], _params(1), request_id="p", hold_prompt_blocks=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.held_hashes("p")
    with pytest.raises(InvalidArgument, match="still holds its prompt's blocks"):
        engine.add_request(PROMPTS[1], _params(1), request_id="p", hold_prompt_blocks=True)
    engine.release_held("p")
    engine.add_request(PROMPTS[1], _params(1), request_id="p")  # free again once released


async def test_an_unnamed_request_streams_under_the_name_the_engine_gives_it(checkpoints):
    ae = AsyncEngine(LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64)))
    ae.start()
    try:
        outs = [out async for out in ae.generate(PROMPTS[0], _params(3), "")]
        assert sum(len(o.new_token_ids) for o in outs) == 3 and outs[-1].request_id.startswith("req-")
    finally:
        ae.stop()
