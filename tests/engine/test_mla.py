"""Multi-head Latent Attention beyond the per-family fidelity test (tests/engine/test_fidelity.py runs DeepSeek-V3
with and without the query's bottleneck, with DeepSeek's YaRN, against transformers): the pool holds the latent
and nothing else, a latent block and a per-head one never mix, the multi-token prediction layers a DeepSeek
checkpoint carries are skipped, and a request's bits under --deterministic do not depend on its batch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.metrics import EngineCollector
from kvmesh.errors import InvalidArgument
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter

from .conftest import PROMPTS, write_checkpoint
from .hf_reference import hf_greedy
from .test_moe import _target_alone_and_in_a_batch
from .test_speculative import ScriptedProposer


def test_the_pool_holds_one_latent_row_a_token_and_layer(checkpoints) -> None:
    path = checkpoints["deepseek-v3"]
    mc = ModelConfig.from_dir(path)
    engine = LLMEngine(path, EngineConfig(num_blocks=32, dtype="float32"))
    per_token = engine.kv.block_nbytes // engine.config.block_size
    assert per_token == mc.num_layers * (mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim) * 4
    assert engine.kv.tensor.numel() * 4 == per_token * 32 * engine.config.block_size  # no hidden copy
    assert engine.kv_layout()["layout"] == "layers,latent,block_tokens,1,latent_width"
    assert mc.kv_bytes_per_token(4) == per_token  # what `kvmesh models check` reports
    gauges = {f.name: f.samples[0].value for f in EngineCollector(engine).collect() if f.samples}
    assert gauges["kvmesh_engine_kv_bytes_per_token"] == per_token


def test_a_latent_block_and_a_per_head_block_never_mix(checkpoints) -> None:
    latent = LLMEngine(checkpoints["deepseek-v3"], EngineConfig(num_blocks=32))
    per_head = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=32))
    block = latent.kv.export_block(1)
    with pytest.raises(InvalidArgument, match=r"\(layers,latent,.*this cache holds .*\(layers,kv,"):
        per_head.kv.import_block(1, block)
    with pytest.raises(InvalidArgument, match=r"\(layers,kv,.*this cache holds .*\(layers,latent,"):
        latent.kv.import_block(1, per_head.kv.export_block(1))


def test_multi_token_prediction_layers_are_skipped(checkpoints, tmp_path) -> None:
    """DeepSeek-V3's checkpoints carry its MTP layer after the last (``model.layers.61`` of 61): not run."""
    path = tmp_path / "mtp"
    shutil.copytree(checkpoints["deepseek-v3"], path)
    tensors = load_file(path / "model.safetensors")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    extra = {k.replace("layers.1.", f"layers.{layers}.", 1): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    save_file(
        {**tensors, **extra, f"model.layers.{layers}.eh_proj.weight": torch.zeros(4, 4)}, path / "model.safetensors"
    )
    got = LLMEngine(path, EngineConfig(num_blocks=64)).generate(
        [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    assert got[0].token_ids == hf_greedy(checkpoints["deepseek-v3"], PROMPTS[0], 16)[0]


# Wide enough that the products take different paths by row count (as tests/engine/test_determinism.py's).
WIDE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, kv_lora_rank=64, q_lora_rank=96)


@pytest.mark.native_cpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_a_request_alone_and_in_a_batch_of_16_are_the_same_bits(tmp_path, dtype) -> None:
    """The absorbed products run per head through invariant_mm, the experts and the attention in their
    batch-invariant forms (without --deterministic the same comparison differs: tests/engine/test_moe.py)."""
    path = write_checkpoint(tmp_path / "wide", "deepseek-v3", **WIDE)
    engine = LLMEngine(path, EngineConfig(num_blocks=256, dtype=dtype, deterministic=True))
    alone, batched = _target_alone_and_in_a_batch(engine)
    assert alone == batched and len(alone[0]) == 16


def test_speculative_verify_rows_keep_transformers_tokens(checkpoints) -> None:
    """Drafts (wrong ones) verified as extra rows through the latent attention and the experts."""
    path = checkpoints["deepseek-v3"]
    drafts = ScriptedProposer({"req-0": [7, 8, 9] * 4})
    engine = LLMEngine(path, EngineConfig(num_blocks=128), drafter=Drafter(drafts, 3, ()))
    got = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [g.token_ids for g in got] == [hf_greedy(path, p, 32)[0] for p in PROMPTS[:2]]
    assert engine.stats.draft_tokens_proposed > 0
