"""Gemma 3 (text) beyond the per-family fidelity test (tests/engine/test_fidelity.py, which runs it against
transformers with tests/engine/conftest.py's checkpoint): its config read in both dialects transformers has
written, what it cannot serve refused by name, and the paths a token takes besides one whole prefill
(chunks, the prefix cache, imported blocks, a speculative verify) giving transformers' tokens."""

from __future__ import annotations

import pytest

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import ModelLoadError
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter

from .hf_reference import hf_greedy
from .test_speculative import ScriptedProposer

N_NEW = 24
PROMPTS = [[(11 * i + 5 * k) % 500 + 1 for i in range(n)] for k, n in enumerate((9, 33, 70))]
BASE = {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


def test_the_config_as_transformers_5_writes_it(checkpoints) -> None:
    cfg = ModelConfig.from_dir(checkpoints["gemma3"])
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.qk_norm and not cfg.qkv_bias
    assert cfg.layer_windows == (16, 0) and cfg.attn_scale == 24**-0.5 and cfg.final_logit_softcap == 3.0
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.rope["rope_type"] == "linear" and cfg.rope["rope_theta"] == 1e6
    assert cfg.local_rope == {"rope_type": "default", "rope_theta": 10000.0}


def test_the_config_as_earlier_releases_wrote_it() -> None:
    cfg = ModelConfig.from_dict({**BASE, "intermediate_size": 8, "num_hidden_layers": 6, "sliding_window": 512,
                                 "sliding_window_pattern": 3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}})  # fmt: skip
    assert cfg.layer_windows == (512, 512, 0, 512, 512, 0)
    assert cfg.rope == {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0}
    assert cfg.local_rope == {"rope_type": "default", "rope_theta": 1e4}


@pytest.mark.parametrize(("field", "value"), [("attn_logit_softcapping", 50.0), ("hidden_activation", "gelu")])
def test_what_gemma_3_text_does_not_compute_is_refused_by_name(field, value) -> None:
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict({**BASE, "intermediate_size": 8, "num_hidden_layers": 1, field: value})


def test_chunks_the_prefix_cache_imported_blocks_and_verify_give_transformers_tokens(checkpoints) -> None:
    path = checkpoints["gemma3"]
    expected = [hf_greedy(path, p, N_NEW)[0] for p in PROMPTS]
    chunked = LLMEngine(path, EngineConfig(num_blocks=64, max_num_batched_tokens=20))
    assert [r.token_ids for r in chunked.generate(PROMPTS, _greedy())] == expected
    again = chunked.generate(PROMPTS, _greedy())
    assert [r.token_ids for r in again] == expected and again[-1].num_cached_tokens == 64
    decode = LLMEngine(path, EngineConfig(num_blocks=64))
    for h, payload in chunked.export_blocks(chunked.prompt_block_hashes(PROMPTS[-1])):
        assert decode.import_block(h, payload)
    assert decode.generate([PROMPTS[-1]], _greedy())[0].token_ids == expected[-1]
    oracle = ScriptedProposer({f"req-{i}": toks for i, toks in enumerate(expected)})
    spec = LLMEngine(path, EngineConfig(num_blocks=64), drafter=Drafter(oracle, 3, ()))
    assert [r.token_ids for r in spec.generate(PROMPTS, _greedy())] == expected
    assert spec.stats.draft_tokens_accepted == spec.stats.draft_tokens_proposed > 0


def test_bfloat16_stays_close_to_float32(checkpoints) -> None:
    """Its norms round the normed row before scaling where transformers scales in float32 first: the
    first tokens of each prompt still agree."""
    path = checkpoints["gemma3"]
    f32 = LLMEngine(path, EngineConfig(num_blocks=64)).generate(PROMPTS, _greedy())
    bf16 = LLMEngine(path, EngineConfig(num_blocks=64, dtype="bfloat16")).generate(PROMPTS, _greedy())
    assert all(a.token_ids[:4] == b.token_ids[:4] for a, b in zip(f32, bf16))
