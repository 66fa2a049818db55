"""A batch-invariant matrix product ``x @ weight.T + bias`` (deterministic serving on GPUs).

cuBLAS picks its algorithm, tile and split-K by the shape, so the same row multiplied alone,
in a decode batch or in a prefill chunk is rounded differently. Here one tile shape serves
every call: an output element is the sum over the input in ``BLOCK_K`` steps, in order, each
step one ``tl.dot`` of the same shape, accumulated in float32, with no split-K. Which rows
share a tile, how many there are and where a row sits among them change nothing in its bits.

The tile is fixed on purpose, not tuned per shape: a 64-row tile wastes most of a decode
step's rows, but decode products are bound by the weight bytes, not the arithmetic, and a
tile chosen by row count would bring back the dependence on the batch (MMA instructions of
other shapes accumulate in other orders). Float32 inputs multiply in IEEE float32 (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._validate import check_same_device, check_tensor, require

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


@triton.jit
def _invariant_mm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    m_rows,
    n_out,
    k_in,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x_tile = tl.load(
            x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < m_rows) & (k[None, :] < k_in), other=0.0
        )
        w_tile = tl.load(  # weight^T's tile [BLOCK_K, BLOCK_N]: the weight is stored [out, in]
            w_ptr + n[None, :] * stride_wn + k[:, None], mask=(n[None, :] < n_out) & (k[:, None] < k_in), other=0.0
        )
        if IEEE:
            acc = tl.dot(x_tile, w_tile, acc, input_precision="ieee")
        else:
            acc = tl.dot(x_tile, w_tile, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < n_out, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + m[:, None] * stride_om + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(m[:, None] < m_rows) & (n[None, :] < n_out),
    )


def invariant_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias [N])`` in x's dtype, each row's result independent of the others."""
    check_tensor("x", x, 2)
    check_tensor("weight", weight, 2)
    require(weight.shape[1] == x.shape[1], f"weight {tuple(weight.shape)} must be [out, {x.shape[1]}] for x's inputs")
    require(weight.dtype == x.dtype, f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if bias is not None:
        check_tensor("bias", bias, 1)
        require(bias.shape == (weight.shape[0],), f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")
        check_same_device(x=x, weight=weight, bias=bias)
    else:
        check_same_device(x=x, weight=weight)
    m_rows, (n_out, k_in) = x.shape[0], weight.shape
    out = torch.empty(m_rows, n_out, dtype=x.dtype, device=x.device)
    if m_rows and n_out:
        grid = (triton.cdiv(m_rows, BLOCK_M), triton.cdiv(n_out, BLOCK_N))
        _invariant_mm_kernel[grid](
            x,
            weight,
            bias if bias is not None else x,  # never read without HAS_BIAS
            out,
            m_rows,
            n_out,
            k_in,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            num_warps=4,
        )
    return out
