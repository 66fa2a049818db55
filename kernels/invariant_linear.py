"""CPU linear layers whose every product is batch-invariant, for deterministic serving.

MKL and oneDNN choose a GEMM's blocking, and with it the order each output element's sum is
rounded in, by the number of rows: a row multiplied alone, in a decode batch of 16 or in a
prefill chunk gets results a few ulps apart (in float32, 523 of 1,000 rows differed from the
same row alone across 11 batch sizes; in bfloat16 the differences reach the logits' first
digits). kernels.cpu's ``invariant_mm`` streams the weight through one fixed sequence of
float32 FMAs per output element, whatever the rows around it, so a token's hidden state is the
same bits wherever it was computed. It is as fast as the library's products at decode sizes
(bound by weight bytes) and slower on prefill chunks (docs/determinism.md measures both).
"""

from __future__ import annotations

import torch
from torch import nn

import kernels.cpu as kernels_cpu
from kernels.errors import KernelUnavailable
from kernels.module_swap import swap_modules

DTYPES = (torch.float32, torch.bfloat16)


class InvariantLinear(nn.Linear):
    """An ``nn.Linear`` (same ``weight``/``bias`` parameters, shared) whose products run
    ``kvmesh_cpu::invariant_mm``."""

    def __init__(self, weight: nn.Parameter | torch.Tensor, bias: torch.Tensor | None) -> None:
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate fresh weights
        if weight.device.type != "cpu" or weight.dtype not in DTYPES:
            raise KernelUnavailable("batch-invariant linears are for float32 or bfloat16 weights on CPU")
        kernels_cpu.load()  # KernelUnavailable (saying why) where the native kernels cannot run
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias

    @classmethod
    def of(cls, linear: nn.Linear) -> InvariantLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        return torch.ops.kvmesh_cpu.invariant_mm(rows, self.weight, self.bias).view(*x.shape[:-1], self.out_features)


def use_invariant_linears(model: nn.Module) -> int:
    """Swap, in place, every plain ``nn.Linear`` of ``model`` for an ``InvariantLinear`` sharing
    its parameters; returns how many were swapped. KernelUnavailable where one cannot run."""
    return swap_modules(model, lambda _, m: type(m) is nn.Linear, InvariantLinear.of)
