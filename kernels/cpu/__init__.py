"""Native CPU kernels: C++ with AVX-512 intrinsics, built on first use by torch's extension
builder (ninja and a C++ compiler) and cached under ``TORCH_EXTENSIONS_DIR``
(``~/.cache/torch_extensions`` by default), so one build serves every later process.

``load()`` builds (or finds) them, registers each with the dispatcher for CPU tensors, and
raises ``KernelUnavailable`` saying why when they cannot run here (a CPU without AVX-512,
no compiler). Triton has no CPU backend in the wheels served here; these fill that role for
the ops where a CPU engine is bound by something torch's own kernels do badly.

- ``int8_scaled_mm`` (``streamed_mm.cpp``): int8 weight-only products of a few rows
  (decode, verify). torch's ``_weight_int8pack_mm`` streamed 7 GB/s here, this 17 GB/s
  (the DRAM rate bf16 products reach), so int8 weights halve a decode step's weight time.
- ``streamed_mm`` (``streamed_mm.cpp``): the same loop over float weights, for the few-row
  products where it outruns torch's (``kernels.small_rows_linear`` measures where).
- ``invariant_mm`` (``streamed_mm.cpp``): that loop for any number of rows, so a row's product
  does not depend on its batch (``kernels.invariant_linear``, deterministic serving); and through it
  the batch-invariant ``moe_experts`` (each expert's rows, grouped as the reference groups them); and
  ``moe_experts`` itself, an expert's few rows (decode) through ``streamed_mm``; ``mla_decode_attention``
  through it, the latent rows as keys and values.
- ``paged_decode_attention`` (``paged_decode_attention.cpp``): one query row per sequence over
  the paged cache, read in place; and ``paged_extend_attention`` (``extend_attention.py``),
  whose rows that attend as decodes go through it, so they round as decode steps do
  (``invariant_extend_attention``: every row, for deterministic serving).
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import torch

from kernels.dispatch import register_cpu_invariant, register_cpu_native
from kernels.errors import KernelUnavailable
from kernels.reference import grouped_experts_op, latent_decode

_SOURCES = [Path(__file__).with_name(name) for name in ("streamed_mm.cpp", "paged_decode_attention.cpp")]
# -fopenmp: at::parallel_for is inlined from ATen's headers as an OpenMP loop; without it the
# kernel would run on one thread.
_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"]

_lock = threading.Lock()
_failure: str | None = None
_loaded = False
_log = logging.getLogger(__name__)


def load() -> None:
    """Build or load the kernels once per process and register them; KernelUnavailable if
    they cannot run on this machine (the reason is kept: later calls raise it at once)."""
    global _failure, _loaded
    with _lock:
        if _loaded:
            return
        if _failure is None:
            _failure = _build()
            _loaded = _failure is None
        if _failure is not None:
            raise KernelUnavailable(f"kvmesh's native CPU kernels are unavailable: {_failure}")


def _build() -> str | None:
    """None once the ops are registered; otherwise why not."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        return f"they need AVX-512 (torch reports {capability} on this CPU)"
    from torch.utils import cpp_extension

    _log.info("loading kvmesh CPU kernels (the first build on a machine takes ~15 s)")
    try:
        cpp_extension.load(
            name="kvmesh_cpu", sources=[str(s) for s in _SOURCES], extra_cflags=_CFLAGS, is_python_module=False
        )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler or ninja, a failed build
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[-1] if lines else 'no message'}"  # a build's last line says why
    from kernels.cpu.extend_attention import invariant_extend_attention, paged_extend_attention

    torch.library.register_fake("kvmesh_cpu::int8_scaled_mm")(_fake_scaled_mm)
    torch.library.register_fake("kvmesh_cpu::streamed_mm")(_fake_streamed_mm)
    torch.library.register_fake("kvmesh_cpu::invariant_mm")(_fake_streamed_mm)
    torch.library.register_fake("kvmesh_cpu::paged_decode_attention")(_fake_decode_attention)
    register_cpu_native("int8_scaled_mm", torch.ops.kvmesh_cpu.int8_scaled_mm)
    register_cpu_native("paged_decode_attention", torch.ops.kvmesh_cpu.paged_decode_attention)
    register_cpu_native("paged_extend_attention", paged_extend_attention)
    register_cpu_invariant("paged_extend_attention", invariant_extend_attention)
    register_cpu_invariant("invariant_mm", torch.ops.kvmesh_cpu.invariant_mm)
    register_cpu_native("moe_experts", cpu_moe_experts)
    register_cpu_native(
        "mla_decode_attention", functools.partial(latent_decode, torch.ops.kvmesh_cpu.paged_decode_attention)
    )
    register_cpu_invariant("moe_experts", invariant_moe_experts)
    return None


# An expert's rows up to this many stream its weights through ``streamed_mm`` (a decode step's few rows an
# expert: MKL's one-row path ran a 1408x512 float32 product in 66 us here, streamed_mm in 28 us); more
# rows (prefill) take the library's GEMM.
EXPERT_STREAMED_ROWS = 8


def _expert_mm(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] <= EXPERT_STREAMED_ROWS:
        return torch.ops.kvmesh_cpu.streamed_mm(rows.contiguous(), weight)
    return torch.nn.functional.linear(rows, weight)


# Custom ops, as ``kernels.reference.moe_experts`` is: torch.compile keeps them whole. ``cpu_moe_experts``
# streams an expert's few rows; ``invariant_moe_experts`` runs every product through ``invariant_mm``, so a
# token's experts round its rows the same whatever other tokens share them.
cpu_moe_experts = grouped_experts_op("kvmesh::cpu_moe_experts", _expert_mm)
invariant_moe_experts = grouped_experts_op(
    "kvmesh::invariant_moe_experts", lambda rows, weight: torch.ops.kvmesh_cpu.invariant_mm(rows, weight)
)


def _fake_scaled_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The output's shape and dtype, for torch.compile's tracing."""
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _fake_streamed_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The output's shape and dtype, for torch.compile's tracing."""
    return x.new_empty((x.shape[0], weight.shape[0]))


def _fake_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """The output's shape and dtype, for torch.compile's tracing."""
    return torch.empty_like(q, memory_format=torch.contiguous_format)
