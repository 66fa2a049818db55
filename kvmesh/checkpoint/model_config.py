"""What the engine and the gateway need from a Hugging Face ``config.json``: ``ModelConfig``.

Read the same way for Llama, Mistral, Qwen2 and Qwen3 and for both config dialects transformers writes
(``rope_theta``/``rope_scaling`` before v5, ``rope_parameters`` after). Torch-free: the gateway reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.checkpoint.config_fields import check_fields
from kvmesh.checkpoint.mla_config import MLAConfig, mla_config, mla_softmax_scale
from kvmesh.checkpoint.moe_config import MoEConfig, moe_config
from kvmesh.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",  # the text model (kvmesh.engine.gemma)
    "Phi3ForCausalLM": "phi3",  # fused projections in the checkpoint (kvmesh.engine.phi3)
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Mixtures of Experts (kvmesh.engine.moe)
    "MixtralForCausalLM": "mixtral",
    # Multi-head Latent Attention over a latent KV pool (kvmesh.engine.mla) and DeepSeek-V3's experts; Kimi K2
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# transformers' own config classes write model_type even when "architectures" is absent.
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()} | {"gemma3_text": "Gemma3ForCausalLM"}

DTYPE_NAMES = ("float32", "float16", "bfloat16")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # kvmesh.engine.rope computes these
# Each family's MLP activation where its config leaves the field out (transformers' config defaults).
_DEFAULT_ACT = {family: "silu" for family in SUPPORTED_ARCHITECTURES.values()} | {"gemma3": "gelu_pytorch_tanh"}


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
    # The checkpoint's dtype name ("bfloat16"): what the engine runs on a GPU unless told otherwise.
    dtype: str
    eos_token_ids: tuple[int, ...]
    # What a family may change of the Llama maths: the attention's softmax scale (Gemma's
    # query_pre_attn_scalar), the MLP's gate activation, and a tanh cap on the final logits.
    attn_scale: float
    hidden_act: str
    final_logit_softcap: float | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    # Each layer's sliding attention window in tokens, 0 where the layer attends to every token before it.
    layer_windows: tuple[int, ...] = ()
    # The rope of the sliding layers where it differs from ``rope`` (Gemma 3's local base); None: the same.
    local_rope: dict[str, Any] | None = None
    # The routed experts of a Mixture-of-Experts family (which layers, how tokens choose); None: dense.
    moe: MoEConfig | None = None
    # Multi-head Latent Attention's shapes; None: per-head K/V. With it the pool's "KV heads" are one latent
    # row per token (``num_kv_heads`` 1, ``head_dim`` the latent's width) and it holds no separate V.
    mla: MLAConfig | None = None

    @property
    def kv_components(self) -> int:
        """What the KV pool holds per token, head and layer: K and V (2), or MLA's one latent (1)."""
        return 1 if self.mla is not None else 2

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """The KV cache one token costs over every layer at ``dtype_bytes`` a value (what MLA's latent saves)."""
        return self.num_layers * self.kv_components * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def sliding_window(self) -> int:
        """The widest window any layer slides (0: no layer does)."""
        return max(self.layer_windows, default=0)

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
        check_fields(raw, source)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            family = SUPPORTED_ARCHITECTURES[arch]
            num_layers = int(raw["num_hidden_layers"])
            head_dim = int(raw.get("head_dim") or hidden // heads)
            rope, local_rope = _ropes(raw)
            for params in (rope, local_rope):
                if params is not None:
                    _check_rope(params, source)
            mla = mla_config(raw, source) if family == "deepseek_v3" else None
            attn_scale = float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            if mla is not None:  # the pool's view: one latent row a token (kvmesh.engine.mla)
                head_dim, kv_heads, attn_scale = mla.latent_width, 1, mla_softmax_scale(mla, rope)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2",  # always; the others' attention_bias is refused (config_fields)
                qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
                rope=rope,
                dtype=_dtype_name(raw.get("dtype") or raw.get("torch_dtype") or "float32", source),
                eos_token_ids=eos_ids,
                attn_scale=attn_scale,
                # Gemma's field is hidden_activation; the others' hidden_act (each ignores the other's).
                hidden_act=raw.get("hidden_activation" if family == "gemma3" else "hidden_act") or _DEFAULT_ACT[family],
                final_logit_softcap=raw.get("final_logit_softcapping"),
                raw=raw,
                layer_windows=_layer_windows(raw, family, num_layers, source),
                local_rope=local_rope,
                moe=moe_config(raw, family, num_layers, source),
                mla=mla,
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing field {e.args[0]!r}") from None


def _layer_windows(raw: dict[str, Any], family: str, num_layers: int, source: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), read as transformers' own model classes read it:
    Llama has none; Mistral slides every layer when ``sliding_window`` is set (its model ignores
    ``layer_types``), and so do Mixtral's and Phi-3's; Qwen2/Qwen3 slide only with ``use_sliding_window``,
    on the layers ``layer_types`` names, or, in configs written before it existed, on layers from
    ``max_window_layers`` on; Qwen3-MoE with ``use_sliding_window`` slides every layer."""
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        window = window if raw.get("use_sliding_window", False) else None
    if family == "llama" or not window:
        return (0,) * num_layers
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"{source}: sliding_window {window!r} is not a positive number of tokens")
    if family in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        return (window,) * num_layers
    types = raw.get("layer_types")
    if types is None and family == "gemma3":  # configs before layer_types: every n-th layer is global
        every = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return tuple(window if (i + 1) % every else 0 for i in range(num_layers))
    if types is None:
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(window if i >= first else 0 for i in range(num_layers))
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != num_layers:
        raise ModelLoadError(
            f"{source}: layer_types {unknown or types!r}: kvmesh serves full_attention and sliding_attention layers, "
            f"one per layer ({num_layers})"
        )
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _ropes(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the rope of full-attention layers, that of sliding layers where it differs): Gemma 3 writes one per
    layer type in ``rope_parameters`` (or, before transformers 5, ``rope_local_base_freq`` beside the rest)."""
    by_type = raw.get("rope_parameters") or {}
    if "full_attention" in by_type or "sliding_attention" in by_type:
        full, local = (
            _rope_params({"rope_parameters": by_type.get(t) or {}}) for t in ("full_attention", "sliding_attention")
        )
        return full, local
    local = raw.get("rope_local_base_freq")
    return _rope_params(raw), None if local is None else {"rope_type": "default", "rope_theta": float(local)}


def _check_rope(params: dict[str, Any], source: str) -> None:
    """ModelLoadError naming the rope setting kvmesh does not compute (``longrope``, partial rotary)."""
    if params["rope_type"] not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope_type {params['rope_type']!r} is not served; served: {', '.join(ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(
            f"{source}: partial_rotary_factor {params['partial_rotary_factor']} is not served (1.0 is)"
        )


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """One RoPE description from either config dialect: {'rope_type', 'rope_theta', ...}."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params.update(scaling)
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def _dtype_name(name: str, source: str) -> str:
    key = str(name).removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ModelLoadError(f"{source}: unsupported dtype {name!r}; choose one of {sorted(DTYPE_NAMES)}")
    return key
