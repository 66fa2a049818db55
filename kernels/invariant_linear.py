"""Linear layers whose every product is batch-invariant, for deterministic serving.

MKL and oneDNN (and cuBLAS) choose a GEMM's blocking, and with it the order each output
element's sum is rounded in, by the number of rows: a row multiplied alone, in a decode batch
of 16 or in a prefill chunk gets results a few ulps apart (on CPU in float32, 523 of 1,000 rows
differed from the same row alone across 11 batch sizes; in bfloat16 the differences reach the
logits' first digits). The ``invariant_mm`` op (``kvmesh_cpu::invariant_mm`` on CPU, which
streams the weight through one fixed sequence of float32 FMAs per output element; the
fixed-tile Triton kernel on GPUs) gives each row the same bits whatever the rows around it, so
a token's hidden state is the same wherever it was computed. On CPU it is as fast as the
library's products at decode sizes (bound by weight bytes) and slower on prefill chunks
(docs/determinism.md measures both).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.errors import KernelUnavailable
from kernels.module_swap import swap_modules

# (x [M, K], weight [N, K], bias [N] | None) -> [M, N]: ``Ops(device, batch_invariant=True).invariant_mm``
InvariantMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

DTYPES = (torch.float32, torch.bfloat16)


class InvariantLinear(nn.Linear):
    """An ``nn.Linear`` (same ``weight``/``bias`` parameters, shared) whose products run ``mm``,
    a batch-invariant ``invariant_mm``."""

    def __init__(self, weight: nn.Parameter | torch.Tensor, bias: torch.Tensor | None, mm: InvariantMM) -> None:
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate fresh weights
        if weight.dtype not in DTYPES:
            raise KernelUnavailable(f"batch-invariant linears are for float32 or bfloat16 weights, not {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.mm = mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        return self.mm(rows, self.weight, self.bias).view(*x.shape[:-1], self.out_features)


def use_invariant_linears(model: nn.Module, mm: InvariantMM) -> int:
    """Swap, in place, every plain ``nn.Linear`` of ``model`` for an ``InvariantLinear`` sharing
    its parameters and running ``mm``; returns how many were swapped."""
    return swap_modules(model, lambda _, m: type(m) is nn.Linear, lambda m: InvariantLinear(m.weight, m.bias, mm))
