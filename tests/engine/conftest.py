"""Tiny checkpoints written by transformers itself (random init, save_pretrained).

Weights use a large init range so logits are peaked: random tiny models with
near-flat logits would make greedy comparisons hinge on float rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.models.bpe import train_tokenizer, write_tokenizer
from kvmesh.sampling import CONTRACT_DEFAULTS, SamplingParams

VOCAB = 512
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.5,
    eos_token_id=0,
)

# name -> (transformers config class, model class, extra config)
ARCHS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-mha-tied": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "num_key_value_heads": 1,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # A 32-token window: prompts with their 32 new tokens run past it (tests/engine/test_sliding_window.py has more).
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 16, "sliding_window": 32}),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0}),
    "qwen2-yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    ),
    "qwen3-qknorm-tied": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    # Fused q/k/v and gate/up in the checkpoint, every layer sliding a 40-token window.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 40, "pad_token_id": 0, "bos_token_id": 1}),
    # Mixtures of Experts: 8 experts of width 32, 2 a token; a dense first layer, weights renormalised.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    # Every layer sparse, the chosen experts' probabilities as they are (Qwen3-30B-A3B's setting).
    "qwen3-moe-unnormed": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": False},
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Multi-head Latent Attention (a 32-wide latent + 16 rotary: a 48-wide pool row) over DeepSeek-V3's layers:
    # a dense first layer, then 8 experts in 2 groups (a token picks 2 from its best group), a shared expert,
    # sigmoid scores with a correction bias (random below: transformers starts it at 0).
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 24,
            "q_lora_rank": 24,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
        },
    ),
    # Without the query's bottleneck (q_proj), with DeepSeek's YaRN: mscale and mscale_all_dim set the
    # rope table's and the softmax's scale.
    "deepseek-v3-yarn": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "q_lora_rank": None,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 2,
            "first_k_dense_replace": 0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
    ),
    # A sliding layer (16-token window, its own rope base) and a global one (linear-scaled rope), Gemma's
    # attention scale, soft-capped logits; its norms get random weights below (transformers starts them at 0).
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 3.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
        },
    ),
}


def write_checkpoint(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    import transformers

    cfg_cls, model_cls, extra = ARCHS[arch]
    cfg = getattr(transformers, cfg_cls)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms at their initial 1 (or Gemma's 0) would hide a norm read wrongly
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and arch.startswith("gemma"):
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's, 0 in a fresh model: random here
                buffer.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


class _Checkpoints(dict):
    """ARCHS' checkpoints, each written the first time a test asks for it (a runner of a few files writes
    only the few it uses)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        if name not in ARCHS:
            raise KeyError(name)
        self[name] = write_checkpoint(self.root / name, name)
        return self[name]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return _Checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(train_tokenizer(VOCAB, corpus_bytes=300_000), path)
    return path


@pytest.fixture(scope="session")
def llama_with_tokenizer(tmp_path_factory, tokenizer_files) -> Path:
    """A llama checkpoint whose folder also has our tokenizer (for text-level tests)."""
    import shutil

    path = write_checkpoint(tmp_path_factory.mktemp("llama-tok") / "m", "llama-gqa", eos_token_id=0)
    for f in tokenizer_files.iterdir():
        shutil.copy(f, path / f.name)
    return path


PROMPTS = [
    [1, 5, 9, 33, 2, 7, 100, 200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [17, 50, 60],
    list(range(40, 90)),
    [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316],
]


def resolved(**settings) -> SamplingParams:
    """Settings as the engine hands them to its sampler and penalties: every unset one resolved."""
    return SamplingParams(**settings).resolve(CONTRACT_DEFAULTS, 1, 1 << 20)
