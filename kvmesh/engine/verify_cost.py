"""What a verify of k drafts costs on this machine, in decode steps' time, measured at start-up.

The draft-length policy (``draft_length.py``) prices a verify of 1, 2, ... drafts against a
plain decode step. That price belongs to the processor, not the model: on the Intel dev
machine (AMX) a float32 verify of 3 / 4 drafts cost 1.56 / 1.64 decodes, where MKL's GEMM
repacks every weight from 4 rows on; on a 2-core AMD EPYC (Zen 5) the same verifies cost
1.1-1.3, and drafting from a head priced by the Intel table stopped at 2 drafts where 4 paid.
So a CPU engine times its own step once: one sequence's decode forward against forwards of
k + 1 new rows (a verify), interleaved so a burst of noise on a shared machine hits every
count alike, best of ``repeats``, plus what the proposer says drafting k tokens takes.

It runs on pool blocks 0.. before any request holds one (their KV is overwritten before
anything reads it), as the compile warm-up does, and through ``model.forward``, so a compiled
decode step is what gets timed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvmesh.engine.model import AttentionMetadata, CausalLM

_log = logging.getLogger(__name__)

# Context of the probe sequence, in blocks: a short chat turn's.
_CONTEXT_BLOCKS = 4


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
    model: CausalLM, kv_cache: torch.Tensor, max_k: int, max_model_len: int,
    draft_seconds: Callable[[int], float] | None = None, repeats: int = 5,
) -> tuple[float, ...]:
    """The draft-cost table for ``max_k`` drafts (``costs_from_seconds``) of ``model`` on its pool
    ``kv_cache`` [layers, 2, blocks, block_size, ...] (contexts up to ``max_model_len``);
    ``draft_seconds(k)``: the proposer's own time to draft k tokens for one sequence (None: free)."""
    block_size = kv_cache.shape[3]
    width = min(_CONTEXT_BLOCKS, kv_cache.shape[2])
    seq_len = min(width * block_size, max_model_len)
    best = [float("inf")] * (max_k + 1)
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms up (allocations, primitives)
            for k in range(max_k + 1):
                t0 = time.perf_counter()
                _verify_forward(model, kv_cache, width, seq_len, k)
                best[k] = min(best[k], time.perf_counter() - t0)
    draft_s = [draft_seconds(k) if draft_seconds else 0.0 for k in range(1, max_k + 1)]
    costs = costs_from_seconds(best[0], best[1:], draft_s)
    _log.info("draft costs measured: decode %.1f ms, verify of 1..%d drafts %s decodes (drafting %s ms)",
              best[0] * 1e3, max_k, list(costs), [round(s * 1e3, 2) for s in draft_s])
    return costs


def _verify_forward(model: CausalLM, kv_cache: torch.Tensor, width: int, seq_len: int, k: int) -> None:
    """One sequence of ``seq_len`` tokens on pool blocks 0..width-1 whose last k + 1 are new
    (k = 0: a decode step), every new row sampling."""
    dev = kv_cache.device
    positions = torch.arange(seq_len - k - 1, seq_len, device=dev)
    meta = AttentionMetadata(
        slot_mapping=positions.clone(),  # block i of the table is pool block i
        block_tables=torch.arange(max(2, width), device=dev).view(1, -1),
        seq_lens=torch.tensor([seq_len], device=dev),
        query_start_loc=torch.tensor([0, k + 1], device=dev),
        is_decode=k == 0,
    )
    model(torch.zeros(k + 1, dtype=torch.long, device=dev), positions, kv_cache, meta, torch.arange(k + 1, device=dev))
