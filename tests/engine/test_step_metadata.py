"""A step's attention metadata: few new tokens a sequence attend as decodes, one per row."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import DECODE_ROWS_MAX
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.model import AttentionMetadata
from kvmesh.engine.step_metadata import step_metadata

CPU = torch.device("cpu")


def test_a_verify_step_is_laid_out_as_one_decode_per_row():
    # Sequence 0: a verify of 2 drafts (3 new tokens, 10 in cache after); sequence 1: a decode.
    meta = step_metadata([20, 21, 22, 50], [[1, 2], [3, 0]], [10, 6], [3, 1], CPU, every_row_samples=True)
    assert meta.is_decode
    assert meta.block_tables.tolist() == [[1, 2], [1, 2], [1, 2], [3, 0]]
    # Each row ends at its own position: it sees its prefix and the new tokens before it.
    assert meta.seq_lens.tolist() == [8, 9, 10, 6]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.slot_mapping.tolist() == [20, 21, 22, 50]


@pytest.mark.parametrize(("n", "every_row_samples"), [(DECODE_ROWS_MAX + 1, True), (3, False)])
def test_a_prefill_chunk_keeps_the_extend_layout(n, every_row_samples):
    """Too many rows to attend one by one, or a short prompt's chunk (only its last row samples)."""
    meta = step_metadata(list(range(n + 1)), [[0, 1], [2, 3]], [n, 7], [n, 1], CPU, every_row_samples)
    assert not meta.is_decode
    assert meta.block_tables.tolist() == [[0, 1], [2, 3]]
    assert meta.seq_lens.tolist() == [n, 7]
    assert meta.query_start_loc.tolist() == [0, n, n + 1]


def test_rows_as_decodes_attend_as_the_extend_layout_does(checkpoints):
    """The same 4-row step through both layouts gives the same logits: each decode row is
    causally masked at its own position (an off-by-one would let it see the next row's K/V)."""
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=32))
    model, pool = engine.model, engine.kv.tensor
    block_size = pool.shape[3]
    table = [0, 1, 2]
    ids = torch.randint(1, 500, (2 * block_size + 4,), generator=torch.Generator().manual_seed(0))
    prefix, new = 2 * block_size, 4

    def slots(positions: range) -> list[int]:
        return [table[p // block_size] * block_size + p % block_size for p in positions]

    def step(meta: AttentionMetadata, positions: range) -> torch.Tensor:
        rows = torch.arange(len(positions))
        return model(ids[positions.start : positions.stop], torch.tensor(list(positions)), pool, meta, rows)

    first = range(0, prefix)
    step(step_metadata(slots(first), [table], [prefix], [prefix], CPU, every_row_samples=False), first)
    last = range(prefix, prefix + new)
    as_decodes = step_metadata(slots(last), [table], [prefix + new], [new], CPU, every_row_samples=True)
    assert as_decodes.is_decode
    extend = AttentionMetadata(
        slot_mapping=as_decodes.slot_mapping,
        block_tables=torch.tensor([table]),
        seq_lens=torch.tensor([prefix + new]),
        query_start_loc=torch.tensor([0, new]),
        is_decode=False,
    )
    torch.testing.assert_close(step(as_decodes, last), step(extend, last), rtol=1e-5, atol=1e-4)
