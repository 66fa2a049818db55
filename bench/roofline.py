"""This machine's ceilings for one decode step of a model: what the engine is measured against.

- Batch 1 is bound by memory: every weight is read once per step, so the ceiling is
  (bytes of weights, as stored: 8-bit ones count 1 byte) / (measured copy bandwidth).
- A batch of N is bound by matmuls: the ceiling is the time torch itself needs for the
  step's matmuls at their real shapes ([N, K] x [K, N_out] for every linear layer and
  the LM head), measured here in the engine's dtype, on the faster of torch's two CPU paths.
Attention, norms and sampling are left out of both: the ceiling is what the weights
alone cost, so a fraction of it says how much of a step is spent on everything else.
"""

from __future__ import annotations

import time

import torch

from kernels.quantized_linear import QuantizedLinear
from kernels.small_rows_linear import MIN_ROWS as SMALL_ROWS_DTYPES


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(in, out) of every matmul in one forward step: each linear (8-bit ones too) and the (tied) LM head."""
    shapes = [
        (m.in_features, m.out_features) for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))
    ]
    if getattr(model, "head_proj", None) is None:  # else the head's product is one of the modules above
        head = model.lm_head if getattr(model, "lm_head", None) is not None else model.embed_tokens
        if not isinstance(head, torch.nn.Linear):
            shapes.append((head.weight.shape[1], head.weight.shape[0]))
    return shapes


def matmul_seconds(shapes: list[tuple[int, int]], batch: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Best-of-``repeats`` time of all the step's matmuls at ``batch`` rows, on the faster of the
    plain weights and oneDNN-reordered ones (kernels.small_rows_linear: which one wins at few
    rows depends on the processor, and the engine runs the faster)."""
    xs = [torch.randn(batch, k, dtype=dtype) for k, _ in shapes]
    ws = [torch.randn(n, k, dtype=dtype) for k, n in shapes]

    def plain() -> None:
        for x, w in zip(xs, ws):
            torch.nn.functional.linear(x, w)

    paths = [plain]
    if dtype in SMALL_ROWS_DTYPES:
        reordered = [torch.ops.mkldnn._reorder_linear_weight(w, batch) for w in ws]

        def onednn() -> None:
            for x, w in zip(xs, reordered):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        paths.append(onednn)
    best = float("inf")
    for step in paths:
        step()
        best = min(best, *(_timed(step) for _ in range(repeats)))
    return best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one step reads: the parameters, and the 8-bit layers' weights and scales (buffers). A tied
    embedding whose head product is 8-bit is left out: a step reads only its few looked-up rows."""
    quantized = [b for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers()]
    params = list(model.parameters())
    if isinstance(getattr(model, "head_proj", None), QuantizedLinear) and getattr(model, "lm_head", None) is None:
        params = [p for p in params if p is not model.embed_tokens.weight]
    return sum(t.numel() * t.element_size() for t in [*params, *quantized])


def ceilings(model: torch.nn.Module, batch: int, dtype: torch.dtype) -> dict[str, float]:
    """Ceiling tokens/s at batch 1 (bandwidth) and at ``batch`` (matmuls), with what they came from."""
    shapes = linear_shapes(model)
    bandwidth = copy_bandwidth()
    mm_s = matmul_seconds(shapes, batch, dtype)
    flops = 2 * batch * sum(k * n for k, n in shapes)
    return {
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes": weight_bytes(model),
        "batch1_tokens_per_s": bandwidth / weight_bytes(model),
        f"batch{batch}_matmul_seconds": mm_s,
        f"batch{batch}_matmul_gflop_s": flops / mm_s / 1e9,
        f"batch{batch}_tokens_per_s": batch / mm_s,
    }
