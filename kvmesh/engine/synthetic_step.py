"""One forward step of made-up sequences over free pool blocks: a compile warm-up, a cost probe.

Both run before any request holds a block, so the KV they write is overwritten before
anything reads it. The tensors are built fresh, as the engine's are: dynamo guards on
whether an input is a view of another, so a view here would compile a graph of its own.
"""

from __future__ import annotations

import torch

from kvmesh.engine.model import AttentionMetadata, CausalLM


def synthetic_step(model: CausalLM, kv_cache: torch.Tensor, batch: int, width: int, seq_len: int,
                   new_tokens: int = 1) -> None:
    """``batch`` sequences of ``seq_len`` tokens, sequence i on pool blocks i*w.. (w = ``width``,
    at least 2 as the engine pads block tables), whose last ``new_tokens`` are new (1: a decode
    step; k + 1: a verify of k drafts), every new row sampling."""
    dev, block_size = kv_cache.device, kv_cache.shape[3]
    new = torch.arange(seq_len - new_tokens, seq_len, device=dev)
    tables = torch.arange(batch * max(2, width), device=dev).view(batch, -1).clone()
    meta = AttentionMetadata(
        slot_mapping=(tables[:, new // block_size] * block_size + new % block_size).flatten().clone(),
        block_tables=tables,
        seq_lens=torch.full((batch,), seq_len, device=dev),
        query_start_loc=torch.arange(batch + 1, device=dev) * new_tokens,
        is_decode=new_tokens == 1,
    )
    rows = batch * new_tokens
    model(torch.zeros(rows, dtype=torch.long, device=dev), new.repeat(batch), kv_cache, meta,
          torch.arange(rows, device=dev))
