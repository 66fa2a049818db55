"""DeepSeek-V3 (and Kimi K2, its architecture): Multi-head Latent Attention over a latent KV pool, with
DeepSeek-V3's Mixture-of-Experts layers (``kvmesh.engine.moe``).

The pool holds, per token and layer, one row of ``kv_lora_rank + qk_rope_head_dim`` values (DeepSeek-V3:
512 + 64): the normed latent ``c`` and the rotated shared key part ``k_pe``; no per-head key or value
(``ModelConfig.kv_components`` is 1). Heads' keys and values are ``c`` through ``kv_b_proj``'s two halves,
``W_UK`` [heads, nope, rank] and ``W_UV`` [heads, v, rank]; kvmesh never expands them. ``W_UK`` is folded
into the query instead (q_nope·(W_UK c) = (q_nope W_UK)·c), so every head attends to the latent rows
themselves, ``[q_nope W_UK, q_pe]·[c, k_pe]``: multi-query attention with one KV "head" as wide as the
row, through the same paged attention ops as every model (decode, extend, chunks, the prefix cache,
verify rows). The rows double as the values; the output's first ``kv_lora_rank`` values are the
attention-weighted latent, and ``W_UV`` after it gives each head's value (the rope part is dropped).

That absorbed form computes the same sums in another order: transformers expands ``c`` per head, so the
two agree to float32 rounding (tests/engine/test_mla.py holds it to transformers' tokens and logprobs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kernels import Ops
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.model import AttentionMetadata, write_layer_kv
from kvmesh.engine.moe import Checkpoint, MoECausalLM, MoEDecoderLayer


class MLADecoderLayer(MoEDecoderLayer):
    def init_attention(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        mla, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * mla.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=False, dtype=dtype)
            self.q_a_norm = nn.Parameter(torch.ones(mla.q_lora_rank, dtype=dtype))
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj = nn.Linear(h, mla.latent_width, bias=False, dtype=dtype)
        self.kv_a_norm = nn.Parameter(torch.ones(mla.kv_lora_rank, dtype=dtype))
        # Read as W_UK and W_UV (``_absorbed``), never run as a product of the latent.
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), False, dtype=dtype
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, h, bias=False, dtype=dtype)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, rank], W_UV [heads, v, rank]): views of ``kv_b_proj``'s weight."""
        mla = self.cfg.mla
        w = self.kv_b_proj.weight.view(self.cfg.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]

    def attention(
        self,
        ops: Ops,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        write_kv=write_layer_kv,
    ) -> torch.Tensor:
        cfg, mla = self.cfg, self.cfg.mla
        t, heads, eps = hidden.shape[0], cfg.num_heads, cfg.rms_norm_eps
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(ops.rms_norm(self.q_a_proj(hidden), self.q_a_norm, eps))
        q_nope, q_pe = q.view(t, heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c = ops.rms_norm(c.contiguous(), self.kv_a_norm, eps)
        q_pe, k_pe = q_pe.contiguous(), k_pe.reshape(t, 1, mla.qk_rope_head_dim)
        if mla.rope_interleave:  # pairs (x0, x1), (x2, x3)... to halves, where the rotary op turns them
            q_pe, k_pe = _halves(q_pe), _halves(k_pe)
        q_pe, k_pe = ops.rotary_embedding(positions, q_pe, k_pe, cos_sin)
        rows = torch.cat([c, k_pe.reshape(t, -1)], dim=-1).unsqueeze(1)  # [T, 1, latent width]
        write_kv(ops, rows, rows, kv_cache, self.index, meta.slot_mapping)
        w_uk, w_uv = self._absorbed()
        q_latent = _per_head(ops, q_nope.transpose(0, 1), w_uk.transpose(1, 2)).transpose(0, 1)  # [T, heads, rank]
        query = torch.cat([q_latent, q_pe], dim=-1)
        pool = kv_cache[self.index, 0]  # keys and values alike: the latent rows
        if meta.is_decode:  # every head block reads a latent row once (kernels/triton/mla_decode.py)
            out = ops.mla_decode_attention(
                query, pool, meta.block_tables, meta.seq_lens, cfg.attn_scale, mla.kv_lora_rank
            )
        else:
            out = ops.paged_extend_attention(
                query, pool, pool, meta.block_tables, meta.query_start_loc, meta.seq_lens, cfg.attn_scale, 0
            )[..., : mla.kv_lora_rank]
        values = _per_head(ops, out.transpose(0, 1), w_uv)  # [heads, T, v]
        hidden = self.o_proj(values.transpose(0, 1).reshape(t, heads * mla.v_head_dim))
        if self.all_reduce is not None:
            self.all_reduce(hidden)
        return hidden


def _per_head(ops: Ops, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [heads, T, in] @ weight [heads, out, in]ᵀ per head: one batched product, or under deterministic
    serving one ``invariant_mm`` a head (a batched GEMM's blocking, and so its rounding, follows T)."""
    if ops.batch_invariant:
        return torch.stack([ops.invariant_mm(x[h].contiguous(), weight[h].contiguous()) for h in range(x.shape[0])])
    return torch.bmm(x, weight.transpose(1, 2))


def _halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary pairs laid out as the halves the neox-style rotation expects (transformers'
    ``apply_rotary_pos_emb_interleave`` computes the same)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class DeepseekV3CausalLM(MoECausalLM):
    LAYER = MLADecoderLayer
    RENAMED = {
        "self_attn.q_proj": "q_proj",
        "self_attn.q_a_proj": "q_a_proj",
        "self_attn.q_a_layernorm": "q_a_norm",
        "self_attn.q_b_proj": "q_b_proj",
        "self_attn.kv_a_proj_with_mqa": "kv_a_proj",
        "self_attn.kv_a_layernorm": "kv_a_norm",
        "self_attn.kv_b_proj": "kv_b_proj",
        "self_attn.o_proj": "o_proj",
        "mlp.down_proj": "down_proj",
        "input_layernorm": "input_norm",
        "post_attention_layernorm": "post_attn_norm",
    }

    def load_weights(self, checkpoint: Checkpoint) -> None:
        """As any MoE model's, without the multi-token prediction layers DeepSeek-V3 checkpoints carry after
        the last layer (``model.layers.{num_hidden_layers}...``): the main model does not run them."""
        layers = self.cfg.num_layers

        def main_model(names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in checkpoint() if names is None else checkpoint(names):
                if not (name.startswith("model.layers.") and int(name.split(".")[2]) >= layers):
                    yield name, tensor

        super().load_weights(main_model)

    def rope_dim(self, cfg: ModelConfig) -> int:
        return cfg.mla.qk_rope_head_dim

    def fused_names(self, cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
        """Only the dense MLP's gate/up are fused: the attention's projections load as they are."""
        return {k: v for k, v in super().fused_names(cfg).items() if k.startswith("mlp.")}

    def _expected_names(self, fused: dict, renamed: dict) -> set[str]:
        lora = self.cfg.mla.q_lora_rank is not None
        unused = ("self_attn.q_proj.",) if lora else ("self_attn.q_a_", "self_attn.q_b_")
        return {n for n in super()._expected_names(fused, renamed) if not any(u in n for u in unused)}
