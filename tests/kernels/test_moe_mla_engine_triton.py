"""DeepSeek-V3 on the Triton path (the one a GPU takes), in the interpreter: an engine whose ops resolve to the
Triton kernels (the fused experts, MLA's decode over the latent rows, the extend attention over them, the
latent pool's KV write) gives transformers' greedy tokens. Small on purpose: every kernel call is
interpreted."""

from __future__ import annotations

import kernels.triton
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from tests.engine.conftest import PROMPTS, write_checkpoint
from tests.engine.hf_reference import hf_greedy


def test_deepseek_v3_gives_transformers_tokens_through_the_triton_kernels(tmp_path, interpret) -> None:
    path = write_checkpoint(tmp_path / "dsv3", "deepseek-v3")
    engine = LLMEngine(path, EngineConfig(num_blocks=32, dtype="float32", max_num_batched_tokens=16))
    ops = engine.runner.model.ops
    assert ops.moe_experts is kernels.triton.KERNELS["moe_experts"]
    assert ops.mla_decode_attention is kernels.triton.KERNELS["mla_decode_attention"]
    prompts = [PROMPTS[0], PROMPTS[1]]  # the first in chunks of 16, beside the second's decodes
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [g.token_ids for g in got] == [hf_greedy(path, p, 6)[0] for p in prompts]
