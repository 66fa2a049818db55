"""One forward step of made-up sequences over free pool blocks: a compile warm-up, a cost probe.

Both run before any request holds a block, so the KV they write is overwritten before
anything reads it. The tensors are built fresh, as the engine's are: dynamo guards on
whether an input is a view of another, so a view here would compile a graph of its own.
"""

from __future__ import annotations

import torch

from kvmesh.engine.model import CausalLM
from kvmesh.engine.step_metadata import step_metadata


def synthetic_step(
    model: CausalLM, kv_cache: torch.Tensor, batch: int, width: int, seq_len: int, new_tokens: int = 1
) -> None:
    """``batch`` sequences of ``seq_len`` tokens, sequence i on pool blocks i*w.. (w = ``width``,
    at least 2 as the engine pads block tables), whose last ``new_tokens`` are new (1: a decode
    step; k + 1: a verify of k drafts), every new row sampling."""
    dev, block_size = kv_cache.device, kv_cache.shape[3]
    w = max(2, width)
    tables = [list(range(i * w, (i + 1) * w)) for i in range(batch)]
    new = range(seq_len - new_tokens, seq_len)
    slots = [t[p // block_size] * block_size + p % block_size for t in tables for p in new]
    meta = step_metadata(slots, tables, [seq_len] * batch, [new_tokens] * batch, dev, every_row_samples=True)
    rows = batch * new_tokens
    model(
        torch.zeros(rows, dtype=torch.long, device=dev),
        torch.tensor(list(new) * batch, device=dev),
        kv_cache,
        meta,
        torch.arange(rows, device=dev),
    )
