"""torch.compile (inductor) of the decode step, with shapes that do not recompile per step.

What is compiled: the model's body (embedding, every layer, final norm) on the decode path
only, as one graph. Decode is where a step is many small ops between the matmuls (norms,
RoPE, SiLU, residual adds, dtype casts) and per-op dispatch is a large share of it;
inductor fuses those, and one graph per step pays dynamo's entry cost once, not per layer.
Prefill/extend steps are matmul-bound and their batched attention branches on the batch's
contents, so they stay eager.

The KV write is an opaque custom op that mutates the whole pool, given the pool and the
layer's index: traced as plain torch, the in-place write into a view of the pool is
functionalized into a copy of the whole pool per layer; and a custom op handed views of
the pool loses all but one layer's writes (torch 2.15's auto-functionalization of several
views of one base), so it gets the base.

Why shapes stay dynamic: a decode step's sequence count and block-table width change every
step. ``dynamic=True`` makes them symbolic, except that dynamo specializes size 1: the
engine pads block tables to at least 2 columns, and the warm-up runs a decode forward for
1 and for 2 sequences (3 blocks each) over free pool blocks (their KV is overwritten before anything reads
it), so both graphs exist before the first request and no later step compiles.
"""

from __future__ import annotations

import functools

import torch
from torch.fx.experimental import _config as fx_config

from kernels import Ops
from kvmesh.engine.model import AttentionMetadata, CausalLM, write_layer_kv

# Graphs one warmed-up engine holds (one sequence; symbolic), with room to spare; past it
# dynamo would run eagerly.
_GRAPH_LIMIT = 8


@torch.library.custom_op("kvmesh::write_layer_kv", mutates_args=("kv_cache",))
def _write_layer_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor
) -> None:
    write_layer_kv(_ops(kv_cache.device), k, v, kv_cache, layer, slot_mapping)


@functools.cache
def _ops(device: torch.device) -> Ops:
    return Ops(device)


@_write_layer_kv.register_fake
def _(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor) -> None:
    return None


def _traced_write(ops: Ops, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  slot_mapping: torch.Tensor) -> None:
    _write_layer_kv(k, v, kv_cache, layer, slot_mapping)


def compile_decode(model: CausalLM, kv_cache: torch.Tensor, block_size: int) -> None:
    """Route ``model``'s decode steps through a compiled body and build its graphs now."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _GRAPH_LIMIT)
    model.write_kv = _traced_write
    model.compiled_decode = torch.compile(model.body, dynamic=True)
    torch._dynamo.mark_static(kv_cache)  # the pool's shape never changes
    # Sizes become symbols here. Without duck shaping, two sizes that happen to be equal in the
    # warm-up (batch and width, or either and a model dimension) do not become one symbol.
    with fx_config.patch(use_duck_shape=False):
        for batch in (1, 2):
            _decode_forward(model, kv_cache, block_size, batch, width=3)


def _decode_forward(model: CausalLM, kv_cache: torch.Tensor, block_size: int, batch: int, width: int) -> None:
    """One synthetic decode step: ``batch`` sequences of ``width`` blocks each, on pool blocks 0..."""
    dev = kv_cache.device
    # Fresh tensors, as the engine's: dynamo guards on whether an input is a view of another.
    tables = torch.arange(batch * width, device=dev).view(batch, width).clone()
    seq_lens = torch.full((batch,), width * block_size, device=dev)
    meta = AttentionMetadata(
        slot_mapping=tables[:, -1] * block_size + block_size - 1,
        block_tables=tables,
        seq_lens=seq_lens,
        query_start_loc=torch.arange(batch + 1, device=dev),
        is_decode=True,
    )
    ids = torch.zeros(batch, dtype=torch.long, device=dev)
    model(ids, seq_lens - 1, kv_cache, meta, torch.arange(batch, device=dev))
