"""The one op dispatcher: every model op goes through here.

Every op has a plain-torch reference (``kernels.reference``). Triton kernels with
identical signatures (``kernels.triton``) register themselves per op and are
picked when the tensors live on CUDA (or when ``TRITON_INTERPRET=1`` asks for
the interpreter in tests). They are imported on the first such request, so
CPU-only use never imports Triton, and a Triton that fails to import leaves the
references in place.

Native CPU kernels (``kernels.cpu``, C++ built on first use) register themselves
when loaded, and are then picked for CPU tensors. ``Ops`` for the CPU loads them (every
CPU model runs their decode attention); where they cannot be built or run, the
references stay, with a warning that says why.

``Ops(device, batch_invariant=True)`` (deterministic serving) takes, per op, the form whose
result for a row does not depend on the rows beside it. On CPU: a batch-invariant native kernel
where the usual one depends on the batch (extend attention, ``invariant_mm``), else the native
kernel, else the reference (whose row-wise ops tests/kernels/test_cpu_batch_invariance.py checks).
On CUDA (or in the interpreter): the batch-invariant Triton kernel where there is one, else the
Triton kernel (tests/kernels/test_batch_invariance.py checks those); never a reference there.
``invariant_mm`` exists only in batch-invariant form: its reference (the library GEMM) is not.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from kernels import reference
from kernels.errors import KernelUnavailable

OPS = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "rotary_embedding",
    "write_kv_cache",
    "paged_decode_attention",
    "paged_extend_attention",
    "mla_decode_attention",
    "quantize_fp8_weight",
    "fp8_scaled_mm",
    "int8_scaled_mm",
    "lora_add",
    "invariant_mm",
    "moe_experts",
)
# Ops that deterministic serving may not take from kernels.reference: the reference depends on the batch.
INVARIANT_ONLY = ("invariant_mm",)

# op name -> Triton implementation, filled when kernels.triton is imported.
_TRITON: dict[str, Callable[..., Any]] = {}
_triton_import_tried = False
# op name -> native CPU implementation, filled by kernels.cpu.load().
_CPU_NATIVE: dict[str, Callable[..., Any]] = {}
# op name -> batch-invariant native CPU / Triton implementation, where the usual one depends on the batch.
_CPU_INVARIANT: dict[str, Callable[..., Any]] = {}
_TRITON_INVARIANT: dict[str, Callable[..., Any]] = {}
_cpu_native_warned = False  # the reason they could not load is logged once per process
_log = logging.getLogger(__name__)


def register_triton(name: str, fn: Callable[..., Any]) -> None:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}")
    _TRITON[name] = fn


def register_cpu_native(name: str, fn: Callable[..., Any]) -> None:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}")
    _CPU_NATIVE[name] = fn


def register_cpu_invariant(name: str, fn: Callable[..., Any]) -> None:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}")
    _CPU_INVARIANT[name] = fn


def register_triton_invariant(name: str, fn: Callable[..., Any]) -> None:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}")
    _TRITON_INVARIANT[name] = fn


def use_triton(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _import_triton_kernels() -> None:
    """Import ``kernels.triton`` once; on failure log why and keep the references."""
    global _triton_import_tried
    if _triton_import_tried:
        return
    _triton_import_tried = True
    try:
        import kernels.triton  # noqa: F401  (registers every kernel)
    except Exception as exc:  # a missing or broken Triton must not take the references down
        _log.warning("Triton kernels unavailable, using torch references: %s: %s", type(exc).__name__, exc)


def get_op(name: str, device: torch.device) -> Callable[..., Any]:
    """The implementation of ``name`` for tensors on ``device``."""
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}")
    if use_triton(device):
        _import_triton_kernels()
        if name in _TRITON:
            return _TRITON[name]
    if device.type == "cpu" and name in _CPU_NATIVE:
        return _CPU_NATIVE[name]
    return getattr(reference, name)


def get_invariant_op(name: str, device: torch.device) -> Callable[..., Any]:
    """The batch-invariant implementation of ``name`` for tensors on ``device`` (CPU: native
    kernels loaded); KernelUnavailable where there is none."""
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}")
    if use_triton(device):
        _import_triton_kernels()
        fn = _TRITON_INVARIANT.get(name) or _TRITON.get(name)
        if fn is None:
            raise KernelUnavailable(f"no batch-invariant Triton kernel for {name} (is Triton installed?)")
        return fn
    if device.type != "cpu":
        raise KernelUnavailable(f"batch-invariant kernels run on CPU or through Triton, not on {device}")
    fn = _CPU_INVARIANT.get(name) or _CPU_NATIVE.get(name)
    if fn is None and name in INVARIANT_ONLY:
        raise KernelUnavailable(f"no batch-invariant CPU kernel for {name}")
    return fn or getattr(reference, name)


class Ops:
    """The ops resolved once for one device, so the hot path does no lookups. With
    ``batch_invariant``, KernelUnavailable (saying why) where they cannot run."""

    def __init__(self, device: torch.device, batch_invariant: bool = False) -> None:
        # Whether every op is in its batch-invariant form: a model's own products outside the ops (MLA's
        # per-head absorptions) then go through ``invariant_mm`` too.
        self.batch_invariant = batch_invariant
        if batch_invariant:
            if device.type == "cpu" and not use_triton(device):
                from kernels import cpu

                cpu.load()
            for name in OPS:
                setattr(self, name, get_invariant_op(name, device))
            return
        if device.type == "cpu":
            _load_cpu_native()
        for name in OPS:
            setattr(self, name, get_op(name, device))


def _load_cpu_native() -> None:
    """Load ``kernels.cpu`` once; where it cannot run, log why (once) and keep the references."""
    global _cpu_native_warned
    from kernels import cpu

    try:
        cpu.load()
    except KernelUnavailable as exc:
        if not _cpu_native_warned:
            _log.warning("%s; CPU models run the torch references", exc)
            _cpu_native_warned = True
