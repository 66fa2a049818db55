"""Kernels: Triton implementations beside plain-torch references, behind one dispatcher."""

from kernels.dispatch import Ops, get_op, register_triton

__all__ = ["Ops", "get_op", "register_triton"]
