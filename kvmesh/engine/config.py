"""Model and engine configuration.

``ModelConfig`` is what the engine needs from a Hugging Face ``config.json``,
read the same way for Llama, Mistral, Qwen2 and Qwen3 and for both config
dialects transformers writes (``rope_theta``/``rope_scaling`` before v5,
``rope_parameters`` after). ``EngineConfig`` holds the knobs of one engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels.small_rows_linear import MIN_ROWS as SMALL_ROWS_DTYPES
from kvmesh.blocks import DEFAULT_BLOCK_SIZE
from kvmesh.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# transformers' own config classes write model_type even when "architectures" is absent.
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: dict[str, Any]
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{cfg_file}: missing (a model folder needs config.json)")
        try:
            raw = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(cfg_file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(raw.get("model_type", ""), "")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            family = SUPPORTED_ARCHITECTURES[arch]
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has qkv bias; Llama/Mistral only when attention_bias says so.
                qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
                qk_norm=family == "qwen3",
                rope=_rope_params(raw),
                dtype=parse_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
                eos_token_ids=eos_ids,
                raw=raw,
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing field {e.args[0]!r}") from None


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """One RoPE description from either config dialect: {'rope_type', 'rope_theta', ...}."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params.update(scaling)
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def parse_draft_costs(text: str | None) -> tuple[float, ...] | None:
    """``"1.2,1.3"`` -> (1.2, 1.3); ``"free"`` -> () (always k drafts); None -> None (the default)."""
    if text is None:
        return None
    if text.strip() == "free":
        return ()
    costs = tuple(float(x) for x in text.split(","))
    if any(c < 1.0 for c in costs) or list(costs) != sorted(costs):
        raise ValueError(f"draft costs must be >= 1 and non-decreasing, got {text!r}")
    return costs


@dataclass
class EngineConfig:
    """Knobs of one engine instance. Defaults suit a small model on CPU."""

    device: str = "cpu"
    # None: the checkpoint's dtype on CUDA, float32 on CPU (CPU bf16 matmul is slow and lossy).
    dtype: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = 512
    max_num_seqs: int = 64
    # Token budget of one step: decodes take 1 each, prefills are chunked to fit.
    max_num_batched_tokens: int = 512
    # Context limit; None: the model's max_position_embeddings.
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    # Weight-only 8-bit weights with per-channel scales (kernels.quantized_linear): "fp8" (CUDA)
    # or "int8" (CUDA, or CPU with AVX-512); None: the weights in the model's dtype.
    quantization: str | None = None
    # With a quantization: the LM head's product in 8 bits too (the embedding lookup keeps the
    # checkpoint's weights). Off by default: its errors go straight into the logits.
    quantize_lm_head: bool = False
    # Draft tokens verified per decode step when a proposer is attached (0 = no speculation).
    num_speculative_tokens: int = 0
    # A verify of 1, 2, ... drafts in decode steps' time (kvmesh.engine.draft_length): fewer
    # drafts for sequences whose drafts miss. None: measured at start-up on CPU
    # (kvmesh.engine.verify_cost), () (drafts free: always k) elsewhere.
    draft_costs: tuple[float, ...] | None = None
    # Run few-row products (up to 64 rows: decode steps, verifies) on oneDNN-reordered copies of
    # the weights (kernels.small_rows_linear; CPU, float32 and bfloat16). Costs a second copy of
    # the weights; False keeps only the checkpoint's (MKL's products).
    small_rows_linears: bool = True
    seed: int = 0
    # torch.compile the decode step's layers (kvmesh.engine.compile): start-up pays the compile.
    compile: bool = False

    def wants_small_rows_linears(self, dtype: torch.dtype) -> bool:
        return self.small_rows_linears and self.device == "cpu" and dtype in SMALL_ROWS_DTYPES

    def resolve_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.dtype is not None:
            return parse_dtype(self.dtype)
        return model_dtype if self.device.startswith("cuda") else torch.float32
