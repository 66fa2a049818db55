"""Gemma 3 (text): the Llama decoder with Gemma's differences, as transformers computes them.

- Four norms a layer ("sandwich"): the attention's and the MLP's outputs are normed before they join
  the residual stream, beside the usual norms before each block.
- RMSNorm scales by ``1 + weight`` (weights are stored as offsets from one): the loaded norm weights
  get 1 added once, so every norm runs the shared ``rms_norm`` op. In float32 that is transformers'
  arithmetic exactly; in bf16 transformers multiplies in float32 before rounding, this rounds the
  normed row first (the last bit of some values differs).
- The embedding is scaled by sqrt(hidden) (in the weights' dtype), the tied LM head is not.
- Attention scales by ``query_pre_attn_scalar ** -0.5``, QK-norm before rope, sliding layers with a
  rope base of their own (``ModelConfig.local_rope``), and a tanh-GELU gated MLP.
- Optional tanh soft-capping of the final logits (``final_logit_softcapping``).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import Ops
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.model import AttentionMetadata, CausalLM, DecoderLayer, write_layer_kv
from kvmesh.engine.rope import rope_cos_sin_cache


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__(cfg, dtype, index)
        self.pre_ff_norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))
        self.post_ff_norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))

    def forward(
        self,
        ops: Ops,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        write_kv=write_layer_kv,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        hidden, residual = self.join_and_norm(ops, hidden, residual)  # ``hidden``: the last layer's normed MLP
        attn = ops.rms_norm(
            self.attention(ops, positions, hidden, kv_cache, cos_sin, meta, write_kv), self.post_attn_norm, eps
        )
        hidden, residual = ops.fused_add_rms_norm(attn, residual, self.pre_ff_norm, eps)
        return ops.rms_norm(self.mlp(ops, hidden), self.post_ff_norm, eps), residual


class Gemma3CausalLM(CausalLM):
    LAYER = Gemma3DecoderLayer
    RENAMED = {
        **CausalLM.RENAMED,
        "pre_feedforward_layernorm": "pre_ff_norm",
        "post_feedforward_layernorm": "post_ff_norm",
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int, *args, **kwargs):
        """As ``CausalLM``'s, plus the sliding layers' rope table where their base differs."""
        super().__init__(cfg, dtype, device, max_positions, *args, **kwargs)
        local = cfg.local_rope
        if local is not None:
            table = rope_cos_sin_cache(local, cfg.head_dim, max_positions, cfg.max_position_embeddings)
            self.register_buffer("cos_sin_local", table, persistent=False)
        else:
            self.cos_sin_local = None

    def cos_sin_of(self, layer: DecoderLayer) -> torch.Tensor:
        return self.cos_sin_local if layer.window and self.cos_sin_local is not None else self.cos_sin

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        return hidden * torch.tensor(self.cfg.hidden_size**0.5, dtype=hidden.dtype)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, features = super().run(input_ids, positions, kv_cache, meta, logits_indices)
        cap = self.cfg.final_logit_softcap
        return (logits if cap is None else torch.tanh(logits / cap) * cap), features

    def load_weights(self, checkpoint) -> None:
        super().load_weights(checkpoint)
        with torch.no_grad():  # Gemma's norms scale by 1 + weight: stored so, once
            for name, param in self.named_parameters():
                if name == "norm" or name.rsplit(".", 1)[-1].endswith("norm"):
                    param.add_(1.0)
