"""What a verify of k drafts costs on this machine, in decode steps' time, measured at start-up.

The draft-length policy (``draft_length.py``) prices a verify of 1, 2, ... drafts against a
plain decode step. That price belongs to the processor, not the model: on the Intel dev
machine (AMX) a float32 verify of 3 / 4 drafts cost 1.56 / 1.64 decodes, where MKL's GEMM
repacks every weight from 4 rows on; on a 2-core AMD EPYC (Zen 5) the same verifies cost
1.1-1.3, and drafting from a head priced by the Intel table stopped at 2 drafts where 4 paid.
So a CPU engine times its own step once: a decode forward against forwards of k + 1 new rows
a sequence (a verify), for one sequence and for a batch (``PROBE_BATCHES``: a batch's verify
rows cost more), interleaved so a burst of noise on a shared machine hits every count alike,
best of ``repeats``, plus what the proposer says drafting k tokens takes.

It runs on pool blocks 0.. before any request holds one (``synthetic_step``, as the compile
warm-up does), and through ``model.forward``, so a compiled decode step is what gets timed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from kernels.small_rows_linear import fastest_alternating
from kvmesh.engine.model import CausalLM
from kvmesh.engine.synthetic_step import synthetic_step

_log = logging.getLogger(__name__)

# Context of the probe sequences, in blocks: a short chat turn's.
_CONTEXT_BLOCKS = 4
# Batch sizes a table is measured at: one sequence, and a batch whose verify rows are no longer
# nearly free. On Zen 5 (SmolLM2 float32) a verify of 1-4 drafts cost 1.24 / 1.21 / 1.27 / 1.34
# decodes alone and 1.31 / 1.58 / 1.86 / 2.15 decodes of 8 sequences at 8.
PROBE_BATCHES = (1, 8)


def costs_from_seconds(decode_s: float, verify_s: list[float], draft_s: list[float]) -> tuple[float, ...]:
    """The policy's table from timings: (verify of k drafts + drafting them) / one decode, for
    k = 1, 2, ...; never below 1 and never falling with k (a longer verify does more work, so a
    dip is noise; the policy needs costs that cannot reward an extra draft for nothing)."""
    costs, floor = [], 1.0
    for verify, draft in zip(verify_s, draft_s):
        floor = max(floor, (verify + draft) / decode_s)
        costs.append(round(floor, 3))
    return tuple(costs)


def measure_draft_costs(
    model: CausalLM,
    kv_cache: torch.Tensor,
    max_k: int,
    max_model_len: int,
    draft_seconds: Callable[[int], float] | None = None,
    repeats: int = 5,
) -> dict[int, tuple[float, ...]]:
    """The draft-cost tables for ``max_k`` drafts (``costs_from_seconds``) of ``model`` on its pool
    ``kv_cache`` [layers, 2, blocks, block_size, ...] (contexts up to ``max_model_len``), per batch
    size of ``PROBE_BATCHES`` the pool has room for; ``draft_seconds(k)``: the proposer's own time
    to draft k tokens for one sequence (None: free; a batch's drafts are drafted together)."""
    block_size, num_blocks = kv_cache.shape[3], kv_cache.shape[2]
    width = min(_CONTEXT_BLOCKS, num_blocks)
    seq_len = min(width * block_size, max_model_len)
    batches = [b for b in PROBE_BATCHES if b == 1 or b * max(2, width) <= num_blocks]
    shapes = [(b, k) for b in batches for k in range(max_k + 1)]
    # Not under inference_mode: tensors made there are inference tensors, which a compiled step's
    # guards tell from the ones its warm-up and the engine make, so the probe would compile and
    # time graphs of its own (model.forward enters inference mode itself).
    seconds = fastest_alternating(
        repeats,
        tuple(
            functools.partial(synthetic_step, model, kv_cache, b, width, seq_len, new_tokens=k + 1) for b, k in shapes
        ),
    )
    best = dict(zip(shapes, seconds))
    draft_s = [draft_seconds(k) if draft_seconds else 0.0 for k in range(1, max_k + 1)]
    tables = {b: costs_from_seconds(best[b, 0], [best[b, k] for k in range(1, max_k + 1)], draft_s) for b in batches}
    _log.info(
        "draft costs measured (verify of 1..%d drafts in decodes; drafting %s ms): %s",
        max_k,
        [round(s * 1e3, 2) for s in draft_s],
        {f"batch {b} (decode {best[b, 0] * 1e3:.1f} ms)": list(t) for b, t in tables.items()},
    )
    return tables
