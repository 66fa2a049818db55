"""Plain-torch reference implementations of every kernel.

These define the ops' semantics. The engine calls them through
``kernels.dispatch`` on CPU; Triton kernels with the same signatures replace
them on CUDA, and tests check the two agree.

Paged KV layout (one layer): ``k_cache``/``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; a sequence's token ``t``
lives in block ``block_table[t // block_size]`` at offset ``t % block_size``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.lora_segments import LoraSegments

# Sequences with at most this many new tokens (a speculative verify has k + 1) attend row by
# row, as decodes: a step made only of such sequences is laid out as decodes
# (``kvmesh.engine.step_metadata``); in a step shared with a longer chunk, below float32, the
# extend attention computes their rows so (``paged_extend_attention``).
DECODE_ROWS_MAX = 16


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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x is [..., 2*d] holding gate then up; returns gelu(gate, tanh approximation) * up (Gemma's GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE. q [T, Hq, D], k [T, Hk, D]; cos_sin_cache [max_pos, D] (cos | sin)."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
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
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    # One index_copy_ over the flat [slots, Hk, D] view: far cheaper on CPU than indexing (block, offset).
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> their K or V as [B, max_blocks * block_size, Hk, D] (index_select:
    about twice as fast as advanced indexing on CPU)."""
    b, nb = block_tables.shape
    _, block_size, hk, d = cache.shape
    return cache.index_select(0, block_tables.reshape(-1)).view(b, nb * block_size, hk, d)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One query token per sequence. q [B, Hq, D]; block_tables [B, max_blocks]; seq_lens [B]
    (including the query token, whose K/V is already in the cache). Returns [B, Hq, D].
    ``window`` > 0: sliding-window attention, the query at position p sees keys p - window < k <= p
    (the last ``window`` tokens, itself included: transformers' sliding window); 0: all of them.

    Batched over sequences: each one's blocks are gathered into a padded [B, S] view and
    positions past its length are masked, so a step costs a few ops per layer, not per sequence.
    """
    k = _gather_blocks(k_cache, block_tables).transpose(1, 2).float()  # [B, Hk, S, D]
    v = _gather_blocks(v_cache, block_tables).transpose(1, 2).float()
    at = torch.arange(k.shape[2], device=q.device)[None, :]
    live = at < seq_lens[:, None]  # [B, S]
    if window:
        live &= at >= (seq_lens - window)[:, None]
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None, :], k, v, attn_mask=live[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :].to(q.dtype)


def mla_decode_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """Multi-head Latent Attention's decode in the absorbed form: q [B, H, D] (every head over the one
    latent row a token, [num_blocks, block_size, 1, D]), the rows serving as keys and, through their
    first ``v_dim`` values, as values. Returns [B, H, v_dim]. Its own op so a kernel can read each latent
    row once for many heads and accumulate only ``v_dim`` outputs; this is its definition."""
    return latent_decode(paged_decode_attention, q, latent_cache, block_tables, seq_lens, scale, v_dim)


def latent_decode(
    decode: Callable[..., torch.Tensor],
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """``mla_decode_attention`` through a ``paged_decode_attention`` ``decode``: the latent rows as keys and
    values, the first ``v_dim`` of its output (the CPU's native decode kernel serves so)."""
    out = decode(q, latent_cache, latent_cache, block_tables, seq_lens, scale, 0)
    return out[..., :v_dim].contiguous()


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Varlen batch of new tokens over a paged prefix. q [T, Hq, D] packs each sequence's new
    tokens at query_start_loc[i]:query_start_loc[i+1]; seq_lens[i] counts prefix + new tokens
    (all already written to the cache). Full attention over the prefix, causal over new tokens.

    Batched, not a loop over sequences. One-token rows (decodes sharing the step) take the
    decode path. In bf16 (any dtype below float32) so do the rows of sequences with up to
    ``DECODE_ROWS_MAX`` new tokens (a speculative verify), each as the decode of its token:
    a masked call over several query rows rounds its float32 result differently in the last
    bits, and rounded to bf16 that became another greedy token a few tokens later, so
    speculation decoded otherwise than plain decoding. In float32 those bits stay below the
    output's rounding (greedy was identical in every benchmark run), and computing a verify
    row by row costs 1-5 ms a step here, so float32 keeps the one call. The others (prefill
    chunks) are padded to the longest and attend in one masked call. ``window``: as in
    ``paged_decode_attention``, for each row at its own position.
    """
    return extend_attention(
        _rows_as_decodes, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window
    )


# (out, q, k_cache, v_cache, block_tables, starts, counts, seq_lens, scale, window): writes into ``out``
# the rows of the sequences whose new tokens start at ``starts`` and number ``counts``, each row
# attending as the decode of its token.
RowsAsDecodes = Callable[..., None]


def extend_attention(
    rows_as_decodes: RowsAsDecodes,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """``paged_extend_attention`` with the rows that attend as decodes computed by
    ``rows_as_decodes``: a native decode kernel plugs in its own, so that a verify row or a
    decode sharing a prefill's step rounds exactly as that kernel's decode does."""
    starts, counts = query_start_loc[:-1], query_start_loc[1:] - query_start_loc[:-1]
    out = torch.empty_like(q)
    as_decodes = DECODE_ROWS_MAX if q.dtype != torch.float32 else 1
    short = (counts <= as_decodes).nonzero().flatten()
    if short.numel():
        rows_as_decodes(
            out, q, k_cache, v_cache, block_tables[short], starts[short], counts[short], seq_lens[short], scale, window
        )
    multi = (counts > as_decodes).nonzero().flatten()
    if multi.numel() == 0:
        return out
    n, first = counts[multi], starts[multi]
    j = torch.arange(int(n.max()), device=q.device)
    valid = j[None, :] < n[:, None]  # [M, max_n]: real query rows, the rest is padding
    rows = first[:, None] + j[None, :]
    padded = q.index_select(0, torch.where(valid, rows, first[:, None]).reshape(-1))
    qp = padded.view(len(multi), len(j), *q.shape[1:]).transpose(1, 2).float()  # [M, Hq, max_n, D]
    k = _gather_blocks(k_cache, block_tables[multi]).transpose(1, 2).float()  # [M, Hk, S, D]
    v = _gather_blocks(v_cache, block_tables[multi]).transpose(1, 2).float()
    q_pos = (seq_lens[multi] - n)[:, None] + j[None, :]  # each query row's position
    at = torch.arange(k.shape[2], device=q.device)[None, None, :]
    visible = at <= q_pos[:, :, None]  # [M, max_n, S]
    if window:
        visible &= at > (q_pos - window)[:, :, None]
    attn = F.scaled_dot_product_attention(qp, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=True)
    out[rows[valid]] = attn.transpose(1, 2)[valid].to(q.dtype)
    return out


def _rows_as_decodes(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> None:
    """Writes into ``out`` the attention of each of these sequences' few new rows, each row
    computed as a decode of its token: one query row against its prefix and itself.

    Rounding follows the shape of a call, so a row must reach the attention as a decode does,
    one query position per (sequence, head). The rows go in as extra query heads, ordered
    (KV head, group, row) so that grouped-query attention still pairs each with its KV head,
    and each with its own causal mask: one call, the K/V gathered once per sequence.
    """
    m, hq, d = len(starts), q.shape[1], q.shape[2]
    hk = k_cache.shape[2]
    group = hq // hk
    j = torch.arange(int(counts.max()), device=q.device)
    n = len(j)
    valid = j[None, :] < counts[:, None]  # [M, n]: real rows; padding repeats a sequence's first
    rows = starts[:, None] + j[None, :]
    qr = q.index_select(0, torch.where(valid, rows, starts[:, None]).reshape(-1)).view(m, n, hk, group, d)
    qh = qr.permute(0, 2, 3, 1, 4).reshape(m, hq * n, 1, d).float()
    k = _gather_blocks(k_cache, block_tables).transpose(1, 2).float()  # [M, Hk, S, D]
    v = _gather_blocks(v_cache, block_tables).transpose(1, 2).float()
    s = k.shape[2]
    q_pos = (seq_lens - counts)[:, None] + j[None, :]  # [M, n]: each row's position
    at = torch.arange(s, device=q.device)[None, None, :]
    live = at <= q_pos[:, :, None]  # [M, n, S]
    if window:
        live &= at > (q_pos - window)[:, :, None]
    mask = live[:, None, None].expand(m, hk, group, n, s).reshape(m, hq * n, 1, s)
    attn = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    attn = attn.view(m, hk, group, n, d).permute(0, 3, 1, 2, 4).reshape(m, n, hq, d)
    out[rows[valid]] = attn[valid].to(q.dtype)


# 8-bit weights (fp8 e4m3 or int8), quantized per output channel, for weight-only quantized
# serving (kernels.quantized_linear). These run anywhere torch has the dtypes.

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
    """x [M, K] @ (qweight [N, K] · scale [N])ᵀ + bias, in float32, returned in x's dtype.
    Also the definition of ``int8_scaled_mm``: only qweight's dtype differs."""
    out = torch.matmul(x.float(), qweight.float().t()) * scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


int8_scaled_mm = fp8_scaled_mm  # qweight int8 [N, K]: the same product (see fp8_scaled_mm)


def invariant_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ + bias in float32, returned in x's dtype: what the batch-invariant
    products compute. This reference itself is not batch-invariant (the library GEMM picks its
    blocking by M), so deterministic serving never falls back to it (``kernels.dispatch.Ops``)."""
    out = torch.matmul(x.float(), weight.float().t())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# ``moe_experts``'s activation names -> the gated op of this module that applies it.
MOE_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def grouped_experts(
    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The routed experts of a Mixture-of-Experts layer: token ``t``'s output is
    ``sum_j topk_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` over its experts ``e = topk_ids[t, j]``.

    x [T, H]; topk_ids [T, k] (int); topk_weights [T, k] (float32 or x's dtype); w_gate_up [E, 2I, H]
    (each expert's gate rows, then its up rows); w_down [E, H, I]; ``activation`` a key of
    ``MOE_ACTIVATIONS``. Returns [T, H] in x's dtype; the weighted sum over a token's k experts is taken
    in float32. An id of -1 contributes nothing: under expert parallelism
    (``kvmesh.engine.moe``) it marks a pair whose expert another rank holds.

    Grouped by expert: the (token, slot) pairs are sorted by expert once and each expert's rows go
    through one product per projection, so the work is one pair of products per expert that has
    tokens, whatever the batch size (never a loop over tokens).

    The products are ``mm(rows, weight)`` = rows @ weightᵀ (``moe_experts``: the library's GEMM; a
    batch-invariant one for deterministic serving, a token's rows then rounding the same whatever shares
    its expert).
    """
    gated = MOE_ACTIVATIONS[activation]
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within one
    # One host read of the counts; the first is of the pairs marked -1, which sort first.
    elsewhere, *counts = torch.bincount(flat + 1, minlength=w_gate_up.shape[0] + 1).tolist()
    rows = x.index_select(0, order[elsewhere:] // k)
    out = torch.empty((t * k, w_down.shape[1]), dtype=x.dtype, device=x.device)
    out[:elsewhere] = 0
    start = elsewhere
    for expert, n in enumerate(counts):
        if n:
            seg = rows[start - elsewhere : start - elsewhere + n]
            out[start : start + n] = mm(gated(mm(seg, w_gate_up[expert])), w_down[expert])
            start += n
    per_pair = torch.empty_like(out)
    per_pair[order] = out  # back to (token, slot) order
    combined = (per_pair.view(t, k, -1).float() * topk_weights.float().unsqueeze(-1)).sum(dim=1)
    return combined.to(x.dtype)


def grouped_experts_op(name: str, mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """``grouped_experts`` with the products ``mm``, as the torch custom op ``name``: torch.compile keeps it
    whole (its grouping reads the per-expert counts on the host, which would break a graph)."""

    def op(
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        return grouped_experts(mm, x, topk_ids, topk_weights, w_gate_up, w_down, activation)

    op.__doc__ = f"``grouped_experts`` with the products of ``{getattr(mm, '__name__', mm)}``."
    custom = torch.library.custom_op(name, op, mutates_args=())
    custom.register_fake(lambda x, *_: torch.empty_like(x))
    return custom


# The op's definition: the products by the library's GEMM.
moe_experts = grouped_experts_op("kvmesh::moe_experts", F.linear)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoraSegments) -> None:
    """Add to ``y`` [T, out] (in place; a column slice of a wider output is fine) each token's own
    adapter's product ``(x @ A_slot^T) @ B_slot`` (nothing for a token without one).

    ``a`` [slots, width, in] and ``b`` [slots, width, out] hold every slot's factors (A as PEFT stores
    it, the adapter's scale already in ``b``). With one slot in use: one product pair over every row,
    masked to that slot's tokens. With more: each slot's tokens gathered into one batch row, a batched
    product pair, and one indexed add back: the same few calls whatever the number of adapters,
    computing each token against its own adapter only.
    """
    n = segments.num_slots
    if n == 1:
        y.addmm_((x @ a[0].t()).mul_(segments.mask(x.dtype)), b[0])
        return
    grouped = x[segments.groups] * segments.group_valid.to(x.dtype)  # [n, G, in]
    delta = torch.bmm(torch.bmm(grouped, a[:n].transpose(1, 2)), b[:n])  # [n, G, out]; padding rows are 0
    y.index_add_(0, segments.groups.flatten(), delta.flatten(0, 1))
