"""Swapping a loaded model's submodules in place (fp8 linears, small-row linears)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap_modules(
    model: nn.Module, keep: Callable[[str, nn.Module], bool], make: Callable[[nn.Module], nn.Module]
) -> int:
    """Replace every submodule ``m`` named ``name`` for which ``keep(name, m)`` holds with
    ``make(m)``, in place; returns how many were replaced. The targets are listed first, so a
    replacement's own children are never visited."""
    targets = [(name, m) for name, m in model.named_modules() if name and keep(name, m)]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(module))
    return len(targets)
