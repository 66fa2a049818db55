"""Plain-torch reference implementations of every kernel.

These define the ops' semantics. The engine calls them through
``kernels.dispatch`` on CPU; Triton kernels with the same signatures replace
them on CUDA, and tests check the two agree.

Paged KV layout (one layer): ``k_cache``/``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; a sequence's token ``t``
lives in block ``block_table[t // block_size]`` at offset ``t % block_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to x's dtype before the weight (as HF does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x is [..., 2*d] holding gate then up; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE. q [T, Hq, D], k [T, Hk, D]; cos_sin_cache [max_pos, D] (cos | sin)."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    return rotate(q), rotate(k)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k/v [T, Hk, D] at flat slots (block * block_size + offset); slot -1 is padding."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[valid].to(v_cache.dtype)


def _gather_seq_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:n_blocks]].flatten(0, 1)[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int) -> torch.Tensor:
    """q [n, Hq, D] at positions q_offset.., k/v [S, Hk, D]; causal; float32 math."""
    n, hq, _ = q.shape
    s, hk, _ = k.shape
    group = hq // hk
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, n, S]
    q_pos = torch.arange(n, device=q.device).unsqueeze(1) + q_offset
    k_pos = torch.arange(s, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)  # [n, Hq, D]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence. q [B, Hq, D]; block_tables [B, max_blocks]; seq_lens [B]
    (including the query token, whose K/V is already in the cache). Returns [B, Hq, D].

    Batched over sequences: each one's blocks are gathered into a padded [B, S] view and
    positions past its length are masked, so a step costs a few ops per layer, not per sequence.
    """
    b, hq, d = q.shape
    _, block_size, hk, _ = k_cache.shape
    s = block_tables.shape[1] * block_size
    k = k_cache[block_tables].view(b, s, hk, d).float().permute(0, 2, 3, 1)  # [B, Hk, D, S]
    v = v_cache[block_tables].view(b, s, hk, d).float().transpose(1, 2)  # [B, Hk, S, D]
    qf = q.float().view(b, hk, hq // hk, d)  # query heads grouped by their KV head
    scores = torch.matmul(qf, k) * scale  # [B, Hk, G, S]
    past_end = torch.arange(s, device=q.device).unsqueeze(0) >= seq_lens.unsqueeze(1)
    scores.masked_fill_(past_end[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, Hk, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen batch of new tokens over a paged prefix. q [T, Hq, D] packs each sequence's new
    tokens at query_start_loc[i]:query_start_loc[i+1]; seq_lens[i] counts prefix + new tokens
    (all already written to the cache). Full attention over the prefix, causal over new tokens."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        k = _gather_seq_kv(k_cache, block_tables[i], seq_len)
        v = _gather_seq_kv(v_cache, block_tables[i], seq_len)
        out[a:b] = _attend(q[a:b], k, v, scale, seq_len - (b - a))
    return out


# FP8 (e4m3) weights, quantized per output channel. Added for fp8 serving; CUDA-only in the
# engine (kernels.fp8_linear), but these run anywhere torch has float8_e4m3fn.

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_SCALE = 1e-12  # an all-zero row's scale, so quantizing it never divides by zero


def quantize_fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], float32 scale [N]), scale[n] = max|weight[n]| / 448,
    so weight ≈ q.float() * scale[:, None] with each row's largest value mapped to 448."""
    wf = weight.float()
    scale = (wf.abs().amax(dim=1) / FP8_E4M3_MAX).clamp_min(FP8_MIN_SCALE)
    q = (wf / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_scaled_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ (qweight [N, K] · scale [N])ᵀ + bias, in float32, returned in x's dtype."""
    out = torch.matmul(x.float(), qweight.float().t()) * scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
