"""Sliding-window attention, where a config sets it: each layer's window read as transformers reads it
(Mistral every layer; Qwen2 by ``use_sliding_window`` and ``layer_types`` / ``max_window_layers``), and
greedy tokens and logprobs equal to transformers' on prompts longer than the window, through every
path a token can take: a prefill (whole or chunked), decode steps, a cached prefix, blocks imported
from another engine (the P/D hand-off) and a speculative verify."""

from __future__ import annotations

import json

import pytest

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import ModelLoadError
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter

from .conftest import write_checkpoint
from .hf_reference import hf_greedy
from .test_speculative import ScriptedProposer

WINDOW = 24  # one and a half 16-token blocks: a window that starts inside a block
N_NEW = 32
# Eight prompts, all but one longer than the window, the longest past several blocks of it.
PROMPTS = [[(7 * i + 3 * k) % 500 + 1 for i in range(n)] for k, n in enumerate((5, 25, 30, 41, 57, 80, 96, 120))]


def _greedy(n: int = N_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("sliding")
    return {
        "mistral": write_checkpoint(root / "mistral", "mistral", sliding_window=WINDOW),
        # Layer 0 full, layer 1 sliding.
        "qwen2": write_checkpoint(
            root / "qwen2", "qwen2-bias", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
    }


def _config(**raw) -> ModelConfig:
    base = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 8}
    return ModelConfig.from_dict({**base, **raw})


def test_each_layer_s_window_is_read_as_transformers_reads_it(models) -> None:
    assert ModelConfig.from_dir(models["mistral"]).layer_windows == (WINDOW, WINDOW)
    assert ModelConfig.from_dir(models["qwen2"]).layer_windows == (0, WINDOW)  # from the layer_types it wrote
    assert _config(model_type="mistral", num_hidden_layers=2, sliding_window=None).layer_windows == (0, 0)
    # Qwen2 configs as the hub ships them: a window that is off, and one before layer_types existed.
    off = _config(model_type="qwen2", num_hidden_layers=3, use_sliding_window=False, sliding_window=4096)
    assert off.layer_windows == (0, 0, 0) and off.sliding_window == 0
    old = _config(model_type="qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=64,
                  max_window_layers=2)  # fmt: skip
    assert old.layer_windows == (0, 0, 64)
    # Llama's attention has no window, whatever the config says.
    assert _config(model_type="llama", num_hidden_layers=1, sliding_window=8).layer_windows == (0,)


def test_a_layer_type_we_do_not_serve_is_refused_by_name() -> None:
    with pytest.raises(ModelLoadError, match="layer_types.*chunked_attention"):
        _config(model_type="qwen3", num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                layer_types=["full_attention", "chunked_attention"])  # fmt: skip
    with pytest.raises(ModelLoadError, match="sliding_window"):
        _config(model_type="mistral", num_hidden_layers=1, sliding_window=-3)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_greedy_matches_transformers_past_the_window(models, family) -> None:
    path = models[family]
    engine = LLMEngine(path, EngineConfig(num_blocks=128))
    results = engine.generate(PROMPTS, _greedy())
    for prompt, res in zip(PROMPTS, results):
        ref_ids, ref_lps = hf_greedy(path, prompt, N_NEW)
        assert res.token_ids == ref_ids, f"{family}: prompt of {len(prompt)} tokens"
        assert max(abs(lp.logprob - r) for lp, r in zip(res.logprobs, ref_lps)) < 1e-4


def test_chunked_prefill_a_cached_prefix_and_imported_blocks_give_the_same_tokens(models) -> None:
    path = models["mistral"]
    expected = [hf_greedy(path, p, N_NEW)[0] for p in PROMPTS[-3:]]
    chunked = LLMEngine(path, EngineConfig(num_blocks=128, max_num_batched_tokens=20))
    assert [r.token_ids for r in chunked.generate(PROMPTS[-3:], _greedy())] == expected
    # Again on the same engine: the prompts' full blocks now come from the prefix cache.
    again = chunked.generate(PROMPTS[-3:], _greedy())
    assert [r.token_ids for r in again] == expected and all(r.num_cached_tokens > WINDOW for r in again)
    # The P/D hand-off in miniature: another engine imports the prompt's blocks and decodes.
    prompt = PROMPTS[-1]
    hashes = chunked.prompt_block_hashes(prompt)
    decode = LLMEngine(path, EngineConfig(num_blocks=128))
    for h, payload in chunked.export_blocks(hashes):
        assert decode.import_block(h, payload)
    got = decode.generate([prompt], _greedy())[0]
    assert got.num_cached_tokens == len(hashes) * 16 and got.token_ids == expected[-1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_verify_rows_slide_as_decodes_do(models, dtype) -> None:
    path = models["qwen2"]
    plain = LLMEngine(path, EngineConfig(num_blocks=128, dtype=dtype)).generate(PROMPTS, _greedy())
    expected = [c.token_ids for c in plain]
    oracle = ScriptedProposer({f"req-{i}": toks for i, toks in enumerate(expected)})
    spec = LLMEngine(path, EngineConfig(num_blocks=128, dtype=dtype), drafter=Drafter(oracle, 4, ()))
    assert [c.token_ids for c in spec.generate(PROMPTS, _greedy())] == expected
    assert spec.stats.draft_tokens_accepted == spec.stats.draft_tokens_proposed > 0


def test_the_window_is_in_the_served_config(models) -> None:
    raw = json.loads((models["mistral"] / "config.json").read_text())
    assert raw["sliding_window"] == WINDOW  # what transformers wrote, so the reference above slides too


def test_blocks_the_window_has_passed_are_released_and_nothing_leaks(models) -> None:
    """Every Mistral layer slides: a running sequence holds the blocks of its window, not of its length."""
    path = models["mistral"]
    engine = LLMEngine(path, EngineConfig(num_blocks=64, max_num_batched_tokens=32))
    engine.add_request(PROMPTS[-1], _greedy(), "long")
    held = []
    while engine.has_unfinished():
        engine.step()
        held += [len(s.block_table) - s.num_dropped_blocks for s in engine.scheduler.running]
    # A 120-token prompt and 32 new tokens fill 10 blocks; the window (24) and the block being written span 3.
    assert max(held[-20:]) <= 3 and len(held) > 20
    assert engine.blocks.num_free == 64


def test_a_pool_too_small_for_whole_sequences_still_serves_transformers_tokens(models) -> None:
    """47 blocks' worth of sequences in a pool of 30: released blocks make room, preemption the rest."""
    path = models["mistral"]
    engine = LLMEngine(path, EngineConfig(num_blocks=30))
    results = engine.generate(PROMPTS, _greedy())
    assert [r.token_ids for r in results] == [hf_greedy(path, p, N_NEW)[0] for p in PROMPTS]
    assert engine.blocks.num_free == 30
