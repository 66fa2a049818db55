"""The segmented LoRA product: the Triton kernel against the reference, and the reference against the
plain per-token definition, in the interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.lora_segments import LoraSegments
from kernels.triton.lora import lora_add
from kernels.triton.testing import poisoned_allocations, relative_error

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def _stacks(slots: int, rank: int, n_in: int, n_out: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(slots, rank, n_in).to(dtype) / n_in**0.5, torch.randn(slots, rank, n_out).to(dtype)


def _per_token(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """The definition, one token at a time in float64."""
    out = torch.zeros(x.shape[0], b.shape[2], dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] = (a[s].double() @ x[t].double()) @ b[s].double()
    return out


# (slot, tokens) per sequence: decodes, a long prefill chunk crossing BLOCK_M, adjacent runs of one
# slot merged, base-model rows between adapters.
RUNS = [
    [(0, 1), (2, 1), (-1, 1), (1, 1), (2, 1)],
    [(0, 30), (-1, 2), (0, 1)],  # one slot in use: the reference's masked path
    [(1, 37), (-1, 5), (0, 3), (0, 2), (3, 20)],
    [(-1, 4), (2, 17)],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("runs", RUNS)
# 48: a fused projection's width (three parts of rank 16), not a power of two.
@pytest.mark.parametrize("rank,n_in,n_out", [(16, 96, 160), (8, 130, 48), (32, 64, 200), (48, 64, 96)])
def test_matches_reference_and_definition(dtype: torch.dtype, runs: list, rank: int, n_in: int, n_out: int) -> None:
    segs = LoraSegments.build(runs, torch.device("cpu"))
    tokens = sum(n for _, n in runs)
    x = torch.randn(tokens, n_in).to(dtype)
    a, b = _stacks(4, rank, n_in, n_out, dtype)
    # The output is a column slice of a wider one, as a fused projection's part is.
    wide = torch.randn(tokens, n_out + 40).to(dtype)
    out, ref = wide.clone(), wide.clone()
    with poisoned_allocations():
        lora_add(out[:, 24 : 24 + n_out], x, a, b, segs)
    reference.lora_add(ref[:, 24 : 24 + n_out], x, a, b, segs)
    assert relative_error(out, ref) < TOLERANCE[dtype]
    slots = [s for s, n in runs for _ in range(n)]
    exact = wide.double()
    exact[:, 24 : 24 + n_out] += _per_token(x, a, b, slots)
    assert relative_error(ref.double(), exact) < TOLERANCE[dtype]
    untouched = torch.tensor(slots) < 0
    assert torch.equal(out[untouched], wide[untouched]), "a token without an adapter must get nothing"
    assert torch.equal(out[:, :24], wide[:, :24]) and torch.equal(out[:, 24 + n_out :], wide[:, 24 + n_out :])


def test_segments_merge_adjacent_runs_of_one_slot() -> None:
    segs = LoraSegments.build([(1, 2), (1, 3), (-1, 1), (0, 1)], torch.device("cpu"))
    assert segs.seg_start.tolist() == [0, 6]
    assert segs.seg_len.tolist() == [5, 1]
    assert segs.seg_slot.tolist() == [1, 0]
    assert segs.num_slots == 2
    assert segs.groups.tolist() == [[6, 0, 0, 0, 0], [0, 1, 2, 3, 4]]
    assert segs.group_valid.flatten().tolist() == [1, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert LoraSegments.build([(-1, 4)], torch.device("cpu")) is None


def test_refuses_mismatched_shapes() -> None:
    segs = LoraSegments.build([(0, 2)], torch.device("cpu"))
    x = torch.randn(2, 32)
    a, b = _stacks(1, 16, 32, 8, torch.float32)
    y = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="for x's inputs"):
        lora_add(y, torch.randn(2, 31), a, b, segs)
    with pytest.raises(ValueError, match="share a dtype"):
        lora_add(y, x.half(), a, b, segs)
    with pytest.raises(ValueError, match=r"must be \[2, 8\]"):
        lora_add(torch.zeros(2, 9), x, a, b, segs)
