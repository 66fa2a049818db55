"""LoRA adapters in the engine: several adapters and the base model in one batch match transformers +
PEFT, their prefixes are cached apart, slots are shared and evicted, broken adapters are refused, and
two tensor-parallel ranks serve what one does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvmesh.blocks import block_hashes
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvmesh.sampling import SamplingParams

from .conftest import PROMPTS
from .peft_reference import ADAPTERS, peft_greedy, write_peft_adapter

N_NEW = 32
ARCH = "llama-gqa"


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        name: write_peft_adapter(checkpoints[ARCH], root / name, seed, **settings)
        for seed, (name, settings) in enumerate(ADAPTERS.items())
    }


def _greedy(logprobs: int = 5) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=logprobs)


def _run(engine: LLMEngine, requests: list[tuple[list[int], str | None]]) -> dict[str, tuple[list[int], list]]:
    rids = [engine.add_request(p, _greedy(), adapter=a) for p, a in requests]
    got: dict[str, tuple[list[int], list]] = {r: ([], []) for r in rids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_logprobs)
    return {r: got[r] for r in rids}


def _engine(path: Path, adapters: dict[str, Path], **cfg) -> LLMEngine:
    engine = LLMEngine(path, EngineConfig(num_blocks=256, **cfg))
    for name, p in adapters.items():
        engine.load_adapter(name, p)
    return engine


@pytest.mark.parametrize("max_loras", [4, 2])  # 2: three adapters take turns in two slots
def test_three_adapters_and_the_base_in_one_batch_match_peft(checkpoints, adapters, max_loras):
    base = checkpoints[ARCH]
    engine = _engine(base, adapters, max_loras=max_loras)
    names = [*adapters, None]
    requests = [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    results = _run(engine, requests)
    for (prompt, name), (ids, lps) in zip(requests, results.values()):
        ref_ids, ref_top = peft_greedy(base, adapters.get(name), prompt, N_NEW)
        assert ids == ref_ids, f"adapter {name}: prompt {prompt[:4]}..."
        for lp, ref in zip(lps, ref_top):
            assert [t for t, _ in lp.top] == [t for t, _ in ref]
            assert max(abs(a - b) for (_, a), (_, b) in zip(lp.top, ref)) < 1e-4
    if max_loras == 4:
        assert {a.name for a in engine.adapters() if a.resident} == set(adapters)


def test_adapters_across_two_ranks_give_one_rank_s_output(checkpoints, adapters):
    """Tensor parallelism: each rank adds its part of every delta (B's rows where a projection's outputs are
    split, A's columns where its inputs are, summed by the layer's all-reduce). Three adapters taking turns
    in two slots (rank 0 sends each follower its part of a slot as it fills it) and the base model, in one
    batch: one rank's tokens, logprobs within 1e-4."""
    names = [*adapters, None]
    requests = [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    one = _run(_engine(checkpoints[ARCH], adapters, max_loras=2), requests)
    engine = _engine(checkpoints[ARCH], adapters, max_loras=2, tensor_parallel_size=2)
    try:
        two = _run(engine, requests)
    finally:
        engine.close()
    for (ids, lps), (ref_ids, ref_lps) in zip(two.values(), one.values()):
        assert ids == ref_ids
        for lp, ref in zip(lps, ref_lps):
            assert [t for t, _ in lp.top] == [t for t, _ in ref.top]
            assert max(abs(a - b) for (_, a), (_, b) in zip(lp.top, ref.top)) < 1e-4


def test_adapters_change_the_output(checkpoints, adapters):
    """Guards the comparison above: each adapter really moves the model's greedy tokens."""
    engine = _engine(checkpoints[ARCH], adapters)
    prompt = PROMPTS[2]
    outs = [ids for ids, _ in _run(engine, [(prompt, a) for a in [*adapters, None]]).values()]
    assert len({tuple(o) for o in outs}) == len(outs)


def test_a_prefix_is_cached_per_adapter(checkpoints, adapters):
    engine = _engine(checkpoints[ARCH], adapters)
    prompt = list(range(100, 180))  # 5 full blocks
    h_qv = engine.prompt_block_hashes(prompt, adapter="qv")
    h_all = engine.prompt_block_hashes(prompt, adapter="all-rslora")
    h_base = engine.prompt_block_hashes(prompt)
    assert h_base == block_hashes(prompt, 16, engine.fingerprint)
    assert not (set(h_qv) & set(h_all)) and not (set(h_qv) & set(h_base)) and not (set(h_all) & set(h_base))

    def cached(adapter: str | None) -> int:
        rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2), adapter=adapter)
        cached_tokens = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    cached_tokens = out.num_cached_tokens
        return cached_tokens

    assert cached("qv") == 0
    assert cached("all-rslora") == 0, "another adapter must not reuse qv's blocks"
    assert cached(None) == 0, "nor the base model"
    assert cached("qv") == 64  # its own: every full block but the one holding the last token
    held = set(engine.blocks.hash_to_block)
    assert set(h_qv[:4]) <= held and set(h_all[:4]) <= held and set(h_base[:4]) <= held


def test_load_unload_and_reload(checkpoints, adapters):
    engine = _engine(checkpoints[ARCH], {})
    info = engine.load_adapter("a", adapters["qv"])
    assert (info.rank, info.resident) == (8, False)
    assert engine.load_adapter("a", adapters["qv"]) == info  # the same files again: a no-op
    with pytest.raises(AlreadyExists, match="already loaded"):
        engine.load_adapter("a", adapters["all-rslora"])
    rid = engine.add_request(PROMPTS[0], _greedy(), adapter="a")
    with pytest.raises(FailedPrecondition, match="serves 1 request"):
        engine.unload_adapter("a")
    engine.abort(rid)
    engine.unload_adapter("a")
    with pytest.raises(NotFound, match="not loaded"):
        engine.add_request(PROMPTS[0], _greedy(), adapter="a")
    with pytest.raises(NotFound):
        engine.unload_adapter("a")
    engine.load_adapter("a", adapters["all-rslora"])  # the name again, other files
    ((ids, _),) = _run(engine, [(PROMPTS[1], "a")]).values()
    assert ids == peft_greedy(checkpoints[ARCH], adapters["all-rslora"], PROMPTS[1], N_NEW)[0]
    assert engine.blocks.num_free == engine.config.num_blocks  # cached, none held


def _broken(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "adapter_model.safetensors")
    conf = json.loads((dst / "adapter_config.json").read_text())
    tensors, conf = edit(tensors, conf)
    save_file(tensors, dst / "adapter_model.safetensors")
    (dst / "adapter_config.json").write_text(json.dumps(conf))
    return dst


def _first(tensors: dict, key: str) -> str:
    return next(k for k in sorted(tensors) if key in k)


BROKEN = {
    "wrong shape": (
        lambda t, c: ({**t, _first(t, "lora_B"): torch.ones(7, 8)}, c),
        r"do not fit a \[\d+ x \d+\] projection",
    ),
    "missing target": (
        lambda t, c: ({k.replace("q_proj", "x_proj"): v for k, v in t.items()}, c),
        "target 'x_proj' is not a projection",
    ),
    "missing half": (lambda t, c: ({k: v for k, v in t.items() if k != _first(t, "lora_A")}, c), "must both be"),
    "layer out of range": (
        lambda t, c: ({k.replace("layers.1.", "layers.9."): v for k, v in t.items()}, c),
        "layer 9 does not exist",
    ),
    "nan": (lambda t, c: ({**t, _first(t, "lora_A"): t[_first(t, "lora_A")] * float("nan")}, c), "NaN"),
    "dora": (lambda t, c: (t, {**c, "use_dora": True}), "DoRA"),
    "rank too high": (lambda t, c: (t, c), "above this worker's max LoRA rank 4"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_adapter_is_refused_and_nothing_else_moves(checkpoints, adapters, tmp_path, case):
    edit, message = BROKEN[case]
    # A worker whose rank limit is 4 serves a rank-4 adapter and refuses the rank-8 one.
    good = adapters["mlp-patterns"] if case == "rank too high" else adapters["qv"]
    engine = _engine(checkpoints[ARCH], {"good": good}, max_lora_rank=4 if case == "rank too high" else 16)
    rid = engine.add_request(PROMPTS[0], _greedy(), adapter="good")
    engine.step()
    with pytest.raises(InvalidArgument, match=message):
        engine.load_adapter("bad", _broken(adapters["qv"], tmp_path / "bad", edit))
    assert [a.name for a in engine.adapters()] == ["good"]
    while engine.has_unfinished():
        engine.step()
    assert rid not in engine._seqs


def test_bad_names_and_lora_off(checkpoints, adapters):
    engine = _engine(checkpoints[ARCH], {})
    with pytest.raises(InvalidArgument, match="adapter name"):
        engine.load_adapter("has space", adapters["qv"])
    with pytest.raises(InvalidArgument, match="not a PEFT adapter folder"):
        engine.load_adapter("x", checkpoints[ARCH])
    off = LLMEngine(checkpoints[ARCH], EngineConfig(num_blocks=64, max_loras=0))
    with pytest.raises(FailedPrecondition, match="LoRA is off"):
        off.load_adapter("x", adapters["qv"])
    with pytest.raises(NotFound, match="LoRA is off"):
        off.add_request(PROMPTS[0], _greedy(), adapter="x")
