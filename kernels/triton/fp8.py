"""FP8 (e4m3) weights: per-output-channel quantization, and a matmul of 16-bit
activations with 8-bit weights, fp8 or int8 (weight-only: half the weight bytes of bf16).

The matmul widens each 8-bit weight tile to the activation dtype in registers —
exact, since every e4m3 value and every integer in [-127, 127] is a bf16 and an fp16
value — runs the tensor-core dot with fp32 accumulation, and applies the channel
scales (and bias) once at the end, so results match the reference up to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE
from kernels.triton._validate import check_same_device, check_tensor, require


@triton.jit
def _quantize_rows_kernel(w_ptr, q_ptr, scale_ptr, stride_w, cols, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                          BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        w = tl.load(w_ptr + row * stride_w + offs, mask=offs < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(w))
    scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        w = tl.load(w_ptr + row * stride_w + offs, mask=offs < cols, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(w / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * cols + offs, q.to(q_ptr.dtype.element_ty), mask=offs < cols)


def quantize_fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], float32 scales [N]) with weight ≈ q * scale[:, None]."""
    check_tensor("weight", weight, 2)
    n, k = weight.shape
    qweight = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty((n,), dtype=torch.float32, device=weight.device)
    if weight.numel():
        _quantize_rows_kernel[(n,)](
            weight, qweight, scale, weight.stride(0), k,
            FP8_MAX=FP8_E4M3_MAX, MIN_SCALE=FP8_MIN_SCALE, BLOCK=min(triton.next_power_of_2(k), 2048), num_warps=4,
        )  # fmt: skip
    return qweight, scale


@triton.jit
def _scaled_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped tile order: GROUP_M row tiles walk the same column tiles together, so the
    # weight tiles they share are still in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    tile_n = (pid % (GROUP_M * tiles_n)) // group_rows

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
    acc *= tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _matmul_config(m: int, n: int) -> dict[str, int]:
    """Few rows (decode) are bound by reading the weights: one row tile, and enough column
    tiles for two or more programs per SM of a large GPU (narrower ones for a narrow layer),
    with K tiles deep enough to keep ~16 KB per pipeline stage in flight. Many rows are
    bound by the tensor cores: large square tiles."""
    if m <= 64:
        block_n = 64 if triton.cdiv(n, 64) >= 256 else 32
        return {"BLOCK_M": max(16, triton.next_power_of_2(m)), "BLOCK_N": block_n, "BLOCK_K": 8192 // block_n,
                "num_warps": 4, "num_stages": 4}  # fmt: skip
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}


def fp8_scaled_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ (qweight [N, K] fp8 · scale [N])ᵀ + bias -> [M, N] in x's dtype."""
    return _scaled_mm(x, qweight, scale, bias, torch.float8_e4m3fn)


def int8_scaled_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ (qweight [N, K] int8 · scale [N])ᵀ + bias -> [M, N] in x's dtype."""
    return _scaled_mm(x, qweight, scale, bias, torch.int8)


def _scaled_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, qdtype: torch.dtype
) -> torch.Tensor:
    check_tensor("x", x, 2)
    check_tensor("qweight", qweight, 2, (qdtype,))
    check_tensor("scale", scale, 1, (torch.float32,))
    m, k = x.shape
    n = qweight.shape[0]
    require(qweight.shape[1] == k, f"qweight has {qweight.shape[1]} input channels, x has {k}")
    require(scale.shape[0] == n, f"scale has {scale.shape[0]} entries for {n} output channels")
    tensors = {"x": x, "qweight": qweight, "scale": scale}
    if bias is not None:
        check_tensor("bias", bias, 1)
        require(bias.shape[0] == n, f"bias has {bias.shape[0]} entries for {n} output channels")
        tensors["bias"] = bias
    check_same_device(**tensors)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cfg = _matmul_config(m, n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _scaled_matmul_kernel[grid](
        x, qweight, scale, bias if bias is not None else scale, out,
        m, n, k, x.stride(0), qweight.stride(0),
        HAS_BIAS=bias is not None, GROUP_M=8, **cfg,
    )  # fmt: skip
    return out
