"""The routed experts of a Mixture-of-Experts layer as two grouped products and a weighted combine.

Same contract as ``kernels.reference.moe_experts``. The (token, slot) pairs are sorted by expert and
laid out in segments padded to ``BLOCK_M`` rows, each ``BLOCK_M``-row block owned by one expert
(``_align_by_expert``, torch ops on the device: no host sync, so a CUDA-graph or an async step
never waits on the routing). Then:

1. one program per (block, column tile of I) multiplies its rows of x by that expert's gate and up
   rows, both in one K loop, and applies the gated activation in the epilogue, writing the [pairs, I]
   intermediate;
2. one program per (block, column tile of H) multiplies those intermediate rows by the expert's
   ``w_down`` into per-pair outputs [pairs, H];
3. one program per (token, column tile) sums its k slots' outputs times their weights in float32,
   slot by slot in order, and casts to x's dtype.

Roundings follow the reference's: each product is rounded to the storage dtype (as ``F.linear``'s
output is), the activation is rounded before it multiplies up, as ``reference.silu_and_mul`` and
``gelu_tanh_and_mul`` do in that dtype (GELU in the sigmoid form of ``silu_mul.py``), and the per-pair
outputs are stored in x's dtype, as the reference's are before it weighs them: half the bytes of
float32 to write and read again, and the same rounding as the reference instead of a closer one
that would differ from it.

Batch invariance (deterministic serving): the tile is fixed (never chosen by the number of tokens),
every product runs its K loop in order with float32 accumulation and no split-K, and the combine
adds a token's slots in order. Which other pairs share a block, and where a pair's row sits in it,
change nothing in its bits, so a token's result does not depend on the other tokens in the batch
(nor does the compiled kernel: the pair count is not specialized on).
A decode step wastes most of each 64-row block, but its products are bound by the expert weights'
bytes, which every block reads once per column tile whatever its rows.

``topk_ids`` must lie in [0, E), or be -1 for a pair whose expert another rank holds (expert
parallelism): those sort into a sentinel expert's blocks, which no program computes, and the combine
skips them. Ids are not read on the host (that would sync); an id outside makes the device-side
``index_select`` fail (an IndexError on CPU, a device assert on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import MOE_ACTIVATIONS
from kernels.triton._validate import INDEX_DTYPES, check_same_device, check_tensor, require
from kernels.triton.silu_mul import _GELU_KAPPA, _TWO_SQRT_2_OVER_PI

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
_COMBINE_BLOCK = 1024


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 operands multiply in IEEE float32, not TF32
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit(do_not_specialize=["num_pairs"])  # one binary whatever the batch's size
def _expert_product_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    pairs_per_a_row,
    n_out,
    k_in,
    stride_a,
    stride_w_expert,
    stride_w_row,
    stride_out,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair, n] = a[pair // pairs_per_a_row] @ w[expert, n]ᵀ for the pairs of one block. GATED: the
    weight holds n_out gate rows then n_out up rows, and out is act(gate) * up."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:  # past the last expert's blocks: the grid is sized for the worst routing
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_ok = pairs < num_pairs  # padding rows hold the sentinel num_pairs
    a_rows = a_ptr + (pairs // pairs_per_a_row) * stride_a
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    w_expert = w_ptr + expert * stride_w_expert
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_in
        a_tile = tl.load(a_rows[:, None] + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[None, :] & k_ok[:, None]
        w_tile = tl.load(w_expert + n[None, :] * stride_w_row + k[:, None], mask=w_mask, other=0.0)  # wᵀ's tile
        acc = _dot(a_tile, w_tile, acc, IEEE)
        if GATED:
            up_tile = tl.load(w_expert + (n_out + n)[None, :] * stride_w_row + k[:, None], mask=w_mask, other=0.0)
            up = _dot(a_tile, up_tile, up, IEEE)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)  # the reference's gate and up products are in the storage dtype
        up = up.to(dtype).to(tl.float32)
        if GELU:  # the sigmoid form of gelu_tanh, which never overflows nor cancels: see silu_mul.py
            z = _TWO_SQRT_2_OVER_PI * (gate + _GELU_KAPPA * gate * gate * gate)
            e = tl.exp(-tl.abs(z))
            act = gate * (tl.where(z >= 0, 1.0, e) / (1.0 + e))
        else:
            act = gate * tl.sigmoid(gate)
        acc = act.to(dtype).to(tl.float32) * up  # rounded before the product, as the reference does
    tl.store(out_ptr + pairs[:, None] * stride_out + n[None, :], acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(
    per_pair_ptr, weights_ptr, ids_ptr, out_ptr, top_k, hidden, stride_weights, stride_ids, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, top_k):  # in slot order, as the reference sums
        if tl.load(ids_ptr + token * stride_ids + j) >= 0:  # -1: another rank's expert, its row never written
            weight = tl.load(weights_ptr + token * stride_weights + j).to(tl.float32)
            row = tl.load(per_pair_ptr + (token * top_k + j) * hidden + cols, mask=mask, other=0.0)
            acc += weight * row.to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _align_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [blocks * BLOCK_M] int32, block_expert [blocks] int32): the pair ids (token * k +
    slot) grouped by expert, in pair order within one, each expert's run padded with the sentinel
    ``pairs`` to whole blocks; and each block's expert, ``num_experts`` for the blocks past the last.

    ``blocks`` comes from the shapes alone: sum over experts of ceil(count / BLOCK_M) is at most
    pairs // BLOCK_M plus the number of experts with pairs. Counts come from searching the sorted ids,
    not ``torch.bincount``, which reads the largest id on the host to size its output.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs, device = flat.numel(), flat.device
    sorted_ids, order = torch.sort(flat, stable=True)
    starts = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=device))
    padded = (starts.diff() + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = padded.cumsum(0)
    # sorted position i of expert e goes to e's padded start plus its rank (i - starts[e]) among e's pairs
    shift = padded_ends - padded - starts[:-1]
    dest = shift.index_select(0, sorted_ids) + torch.arange(pairs, device=device)
    blocks = pairs // BLOCK_M + min(num_experts, pairs)
    sorted_pairs = torch.full((blocks * BLOCK_M,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, blocks * BLOCK_M, BLOCK_M, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    check_tensor("x", x, 2)
    check_tensor("topk_ids", topk_ids, 2, INDEX_DTYPES)
    check_tensor("topk_weights", topk_weights, 2, (torch.float32, x.dtype))
    check_tensor("w_gate_up", w_gate_up, 3)
    check_tensor("w_down", w_down, 3)
    check_same_device(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w_gate_up=w_gate_up, w_down=w_down)
    require(activation in MOE_ACTIVATIONS, f"activation must be one of {list(MOE_ACTIVATIONS)}, got {activation!r}")
    (tokens, hidden), (experts, two_i, _) = x.shape, w_gate_up.shape
    inter = two_i // 2
    require(topk_ids.shape[0] == tokens, f"topk_ids {tuple(topk_ids.shape)} must be [{tokens}, k] for x's tokens")
    require(topk_weights.shape == topk_ids.shape, f"topk_weights {tuple(topk_weights.shape)} must match topk_ids")
    require(
        two_i % 2 == 0 and w_gate_up.shape[2] == hidden,
        f"w_gate_up {tuple(w_gate_up.shape)} must be [experts, 2 * intermediate, {hidden}] (gate rows, then up)",
    )
    require(
        w_down.shape == (experts, hidden, inter), f"w_down {tuple(w_down.shape)} must be [{experts}, {hidden}, {inter}]"
    )
    dtypes = (x.dtype, w_gate_up.dtype, w_down.dtype)
    require(len(set(dtypes)) == 1, f"x, w_gate_up, w_down must share a dtype, got {', '.join(map(str, dtypes))}")
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    if not (pairs and hidden and inter):  # nothing to sum: the reference's output is zeros
        return torch.zeros((tokens, hidden), dtype=x.dtype, device=x.device)
    # Pairs of other ranks' experts (-1) go to a sentinel expert past the last, whose blocks are skipped; an
    # id of E itself is moved past the sentinel, so it still fails the alignment's index_select.
    ids = topk_ids.masked_fill(topk_ids == experts, experts + 1).masked_fill(topk_ids == -1, experts)
    sorted_pairs, block_expert = _align_by_expert(ids, experts + 1)
    blocks = block_expert.numel()
    common = {"IEEE": x.dtype == torch.float32, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}
    intermediate = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _expert_product_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        x, w_gate_up, intermediate, sorted_pairs, block_expert, pairs, experts, top_k, inter, hidden,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), intermediate.stride(0),
        GATED=True, GELU=activation == "gelu_tanh", num_warps=4, **common,
    )  # fmt: skip
    per_pair = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    _expert_product_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        intermediate, w_down, per_pair, sorted_pairs, block_expert, pairs, experts, 1, hidden, inter,
        intermediate.stride(0), w_down.stride(0), w_down.stride(1), per_pair.stride(0),
        GATED=False, GELU=False, num_warps=4, **common,
    )  # fmt: skip
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(hidden), _COMBINE_BLOCK)
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        per_pair,
        topk_weights,
        topk_ids,
        out,
        top_k,
        hidden,
        topk_weights.stride(0),
        topk_ids.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return out
