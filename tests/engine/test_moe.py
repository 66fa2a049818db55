"""Mixtures of Experts beyond the per-family fidelity test (tests/engine/test_fidelity.py runs Qwen3-MoE with
and without renormalised weights, and Mixtral, against transformers): DeepSeek-V3's routing against
transformers' own ``DeepseekV3MoE`` module, transformers' fused 3D expert layout, chunks and the prefix
cache, compiled decode, deterministic serving, per-expert load as metrics, and what is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import Ops
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.checkpoint.moe_config import moe_config
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.metrics import EngineCollector
from kvmesh.engine.moe import SparseMoE, _copy_into, expert_tokens
from kvmesh.engine.moe_routing import route
from kvmesh.errors import FailedPrecondition, InvalidArgument, ModelLoadError
from kvmesh.sampling import SamplingParams

from .conftest import PROMPTS, write_checkpoint
from .hf_reference import hf_greedy
from .peft_reference import write_peft_adapter

N_NEW = 32


def _greedy(n: int = N_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _deepseek_v3_moe(seed: int):
    """transformers' DeepseekV3MoE with 16 experts in 4 groups (a token picks 4 experts from its 2 best groups),
    a shared expert, a scaling factor and a random correction bias; and its config as a dict."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = transformers.DeepseekV3Config(
        hidden_size=64,
        moe_intermediate_size=24,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        num_hidden_layers=3,
    )
    torch.manual_seed(seed)
    module = DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
        module.gate.e_score_correction_bias.normal_(0.0, 0.5)
    return module, cfg.to_dict()


def _ours_of(module, raw: dict) -> SparseMoE:
    moe = moe_config(raw, "deepseek_v3", raw["num_hidden_layers"], "test")
    ours = SparseMoE(moe, raw["hidden_size"], "silu", torch.float32)
    state = {**module.state_dict(), "gate.e_score_correction_bias": module.gate.e_score_correction_bias}
    for name, tensor in state.items():
        # transformers holds its experts fused in memory; checkpoints hold them one by one (both load).
        _copy_into(ours, name, tensor, name)
    return ours


def test_deepseek_v3_routing_shared_experts_and_scaling_match_transformers_module() -> None:
    module, raw = _deepseek_v3_moe(seed=0)
    ours = _ours_of(module, raw)
    assert ours.cfg.sparse_layers == (False, True, True)  # first_k_dense_replace=1
    x = torch.randn(40, 64)
    with torch.no_grad():
        expected = module(x.unsqueeze(0))[0]
        _, _, expected_ids = module.gate(x)
    got = ours(Ops(torch.device("cpu")), x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    _, ids = route(ours.router(x), ours.cfg, ours.correction_bias)
    assert torch.equal(ids.sort(-1).values, expected_ids.sort(-1).values)
    # The group limit binds: without it some token would take an expert from a third group.
    free = torch.topk(torch.sigmoid(ours.router(x)) + ours.correction_bias, 4, dim=-1).indices
    assert not torch.equal(free.sort(-1).values, ids.sort(-1).values)


@pytest.mark.parametrize(
    ("field", "value"), [("scoring_func", "softmax"), ("topk_method", "group_limited_greedy"), ("n_group", 3)]
)
def test_a_deepseek_routing_we_do_not_compute_is_refused_by_name(field, value) -> None:
    _, raw = _deepseek_v3_moe(seed=0)
    with pytest.raises(ModelLoadError, match=field):
        moe_config({**raw, field: value}, "deepseek_v3", 3, "config.json")


def test_more_experts_a_token_than_the_model_has_is_refused(checkpoints, tmp_path) -> None:
    raw = json.loads((checkpoints["mixtral"] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=5 with 4 experts"):
        ModelConfig.from_dict({**raw, "num_experts_per_tok": 5})


def test_fused_3d_expert_tensors_load_like_per_expert_ones(checkpoints, tmp_path) -> None:
    """transformers' in-memory layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
    path = tmp_path / "fused"
    shutil.copytree(checkpoints["qwen3-moe"], path)
    tensors = load_file(path / "model.safetensors")
    experts = json.loads((path / "config.json").read_text())["num_local_experts"]
    fused = {}
    for layer in (1,):  # layer 0 is dense (mlp_only_layers)
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = [
            torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
            for e in range(experts)
        ]
        fused[p + "gate_up_proj"] = torch.stack(gate_up)
        fused[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(experts)])
    save_file({**tensors, **fused}, path / "model.safetensors", metadata={"format": "pt"})
    got = LLMEngine(path, EngineConfig(num_blocks=64)).generate(PROMPTS[:2], _greedy())
    assert [g.token_ids for g in got] == [hf_greedy(checkpoints["qwen3-moe"], p, N_NEW)[0] for p in PROMPTS[:2]]


def test_a_missing_expert_is_named(checkpoints, tmp_path) -> None:
    path = tmp_path / "holed"
    shutil.copytree(checkpoints["mixtral"], path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.layers.1.expert.3.up"):
        LLMEngine(path, EngineConfig(num_blocks=16))


def test_chunked_prefill_and_the_prefix_cache_keep_transformers_tokens(checkpoints) -> None:
    path = checkpoints["qwen3-moe-unnormed"]
    engine = LLMEngine(path, EngineConfig(num_blocks=128, max_num_batched_tokens=24))
    expected = [hf_greedy(path, p, N_NEW)[0] for p in PROMPTS]
    assert [r.token_ids for r in engine.generate(PROMPTS, _greedy())] == expected
    hits = engine.stats.cached_prompt_tokens
    assert [r.token_ids for r in engine.generate(PROMPTS, _greedy())] == expected
    assert engine.stats.cached_prompt_tokens > hits


def test_every_prompt_token_is_routed_to_k_experts_in_every_sparse_layer(checkpoints) -> None:
    engine = LLMEngine(checkpoints["qwen3-moe"], EngineConfig(num_blocks=64))
    before = expert_tokens(engine.model)
    assert sorted(before) == [1]  # layer 0 is dense
    engine.generate([PROMPTS[2]], _greedy(1))
    routed = [a - b for a, b in zip(expert_tokens(engine.model)[1], before[1])]
    assert sum(routed) == len(PROMPTS[2]) * 2 and len(routed) == 8


def test_metrics_count_each_expert_s_tokens_from_when_serving_started(checkpoints) -> None:
    engine = LLMEngine(checkpoints["mixtral"], EngineConfig(num_blocks=64))
    engine.generate([PROMPTS[0]], _greedy(1))  # before the collector: a warm-up, as far as it knows
    collector = EngineCollector(engine)
    engine.generate([PROMPTS[1]], _greedy(1))
    families = {f.name: f for f in collector.collect()}
    samples = families["kvmesh_moe_expert_tokens"].samples
    assert {s.labels["layer"] for s in samples} == {"0", "1"} and len(samples) == 2 * 4
    assert sum(s.value for s in samples if s.labels["layer"] == "0") == len(PROMPTS[1]) * 2
    for s in families["kvmesh_moe_expert_imbalance"].samples:
        assert 1.0 <= s.value <= 4.0


def test_lora_on_experts_and_8_bit_experts_are_refused_clearly(checkpoints, tmp_path) -> None:
    path = checkpoints["qwen3-moe"]
    with pytest.raises(FailedPrecondition, match="8-bit weights for Mixture-of-Experts"):
        LLMEngine(path, EngineConfig(num_blocks=16, quantization="int8"))
    engine = LLMEngine(path, EngineConfig(num_blocks=16, max_loras=1, max_lora_rank=8))
    attention = write_peft_adapter(path, tmp_path / "attn", seed=1, target_modules=["q_proj", "v_proj"])
    engine.load_adapter("attn", str(attention))  # attention projections are served
    mlp = write_peft_adapter(path, tmp_path / "mlp", seed=1, target_modules=["down_proj"])
    with pytest.raises(InvalidArgument, match="experts"):
        engine.load_adapter("mlp", str(mlp))


@pytest.mark.slow  # compiles three decode graphs
def test_compiled_decode_matches_transformers(checkpoints) -> None:
    """DeepSeek-V3: the experts' op kept whole in the graphs, and the latent pool's one-row KV write traced."""
    path = checkpoints["deepseek-v3"]
    engine = LLMEngine(path, EngineConfig(num_blocks=128, compile=True))
    got = engine.generate(PROMPTS, _greedy())
    assert [g.token_ids for g in got] == [hf_greedy(path, p, N_NEW)[0] for p in PROMPTS]


WIDE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
TARGET = [(7 * i + 3) % 500 + 1 for i in range(45)]
OTHERS = [[(11 * i + j) % 500 + 1 for i in range(5 + 9 * j)] for j in range(15)]


def _target_alone_and_in_a_batch(engine: LLMEngine) -> tuple[tuple, tuple]:
    params = _greedy(16, logprobs=5)

    def run(others: list[list[int]]) -> tuple:
        for p in others:
            engine.add_request(p, _greedy(20))
        rid = engine.add_request(TARGET, params)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.request_id == rid]
        return tuple(t for o in outs for t in o.new_token_ids), tuple(
            lp.logprob.hex() for o in outs for lp in o.new_logprobs
        )

    return run([]), run(OTHERS)


@pytest.mark.native_cpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_a_request_alone_and_in_a_batch_of_16_are_the_same_bits(tmp_path, dtype) -> None:
    path = write_checkpoint(tmp_path / "wide", "qwen3-moe", **WIDE)
    alone, batched = _target_alone_and_in_a_batch(
        LLMEngine(path, EngineConfig(num_blocks=256, dtype=dtype, deterministic=True))
    )
    assert alone == batched and len(alone[0]) == 16


@pytest.mark.slow  # starts a rank process per case
@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral", "deepseek-v3"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-by-columns", "expert-parallel"])
def test_two_ranks_give_transformers_tokens(checkpoints, arch, expert_parallel) -> None:
    """TP2 with every expert's columns split, and TP2 + EP2 with each rank holding half the experts whole
    (DeepSeek-V3: its latent attention's heads split, the latent whole on both ranks)."""
    path = checkpoints[arch]
    cfg = EngineConfig(num_blocks=64, tensor_parallel_size=2, expert_parallel=expert_parallel)
    engine = LLMEngine(path, cfg)
    try:
        got = engine.generate(PROMPTS, _greedy(logprobs=0))
    finally:
        engine.close()
    for prompt, res in zip(PROMPTS, got):
        ids, logprobs = hf_greedy(path, prompt, N_NEW)
        assert res.token_ids == ids
        assert max(abs(a.logprob - b) for a, b in zip(res.logprobs, logprobs)) < 1e-4
