"""The fused MoE kernel (grouped gate-up product with the activation, grouped down product, weighted
combine) against ``reference.moe_experts`` in the interpreter, its expert layout, and a token's bits
alone vs in a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

from kernels import reference
from kernels.triton.fused_moe import BLOCK_M, _align_by_expert, moe_experts
from kernels.triton.testing import poisoned_allocations, relative_error

# With the interpreter's bfloat16 mended (the fixture below), every dtype matches the reference up to
# summation order: a rounding it moves is one ulp of one element, far under these bounds in norm.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTIVATIONS = list(reference.MOE_ACTIVATIONS)
HIDDEN, INTER, EXPERTS, TOP_K = 48, 40, 5, 2  # neither HIDDEN nor INTER a multiple of the 64-wide tiles


@pytest.fixture(autouse=True)
def bfloat16_as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter holds bfloat16 as raw uint16 (numpy has no bfloat16): its tl.dot multiplies those
    integers, and its float32 -> bfloat16 cast truncates. Here a dot widens bfloat16 tiles to float32
    first (exact, as a GPU's products in its float32 accumulator are) and the cast rounds to nearest
    even, as a GPU and torch do, so bfloat16 is held to the reference as tightly as float16."""
    create_dot, cast_impl = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl

    def widening_dot(
        self: InterpreterBuilder, a: TensorHandle, b: TensorHandle, d: TensorHandle, *args
    ) -> TensorHandle:
        a, b = (cast_impl(self, t, tl.float32) if t.dtype.scalar == tl.bfloat16 else t for t in (a, b))
        return create_dot(self, a, b, d, *args)

    def rounding_cast(self: InterpreterBuilder, src: TensorHandle, dst_type: tl.dtype) -> TensorHandle:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return TensorHandle(rounded.view(torch.uint16).numpy(), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", widening_dot)
    monkeypatch.setattr(InterpreterBuilder, "cast_impl", rounding_cast)


def _weights(experts: int, hidden: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w_gate_up [experts, 2 * inter, hidden], w_down [experts, hidden, inter], each product's outputs O(1)."""
    w_gate_up = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    return w_gate_up, (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)


def _routing(tokens: int, k: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (a token may pick one expert twice) and softmax weights, as a router gives them."""
    return torch.randint(0, experts, (tokens, k)), torch.randn(tokens, k).softmax(-1)


def _check(x, ids, weights, w_gate_up, w_down, activation: str) -> None:
    with poisoned_allocations():  # an output element never written is NaN
        out = moe_experts(x, ids, weights, w_gate_up, w_down, activation)
    ref = reference.moe_experts(x, ids, weights, w_gate_up, w_down, activation)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert relative_error(out, ref) < TOLERANCE[x.dtype]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_matches_reference(activation: str, dtype: torch.dtype, tokens: int) -> None:
    ids, weights = _routing(tokens, TOP_K, EXPERTS)
    weights = weights if tokens % 2 else weights.to(dtype)  # float32 weights, or the storage dtype's
    _check(torch.randn(tokens, HIDDEN).to(dtype), ids, weights, *_weights(EXPERTS, HIDDEN, INTER, dtype), activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_several_tiles_in_every_dimension(activation: str) -> None:
    # 150 pairs over 3 experts: some expert has more than one 64-row block. Hidden 80 and intermediate 72:
    # two K steps and two column tiles in each product, the second partial.
    ids, weights = _routing(50, 3, 3)
    x = torch.randn(50, 80).to(torch.float16)
    _check(x, ids, weights, *_weights(3, 80, 72, torch.float16), activation)


def test_unused_experts_duplicated_slots_and_k_1() -> None:
    ids = torch.tensor([[3, 3], [1, 3], [3, 1], [1, 1]])  # experts 0, 2 and 4 get nothing
    x = torch.randn(4, HIDDEN).to(torch.float16)
    w_gate_up, w_down = _weights(EXPERTS, HIDDEN, INTER, torch.float16)
    _check(x, ids, torch.rand(4, 2), w_gate_up, w_down, "silu")
    _check(x, ids[:, :1], torch.rand(4, 1), w_gate_up, w_down, "gelu_tanh")


def test_blocks_exactly_full() -> None:
    tokens = 2 * BLOCK_M  # all on one expert, k = 1: no padding row anywhere
    ids, weights = torch.full((tokens, 1), EXPERTS - 1), torch.rand(tokens, 1)
    _check(torch.randn(tokens, HIDDEN), ids, weights, *_weights(EXPERTS, HIDDEN, INTER, torch.float32), "silu")


def test_strided_rows() -> None:
    x = torch.randn(7, HIDDEN + 16)[:, :HIDDEN]  # rows HIDDEN + 16 apart
    ids, weights = _routing(7, TOP_K, EXPERTS)
    weights = torch.cat([weights, torch.rand(7, 1)], dim=1)[:, :TOP_K]
    _check(x, ids.to(torch.int32), weights, *_weights(EXPERTS, HIDDEN, INTER, torch.float32), "gelu_tanh")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_alone_equals_its_row_in_a_batch(dtype: torch.dtype) -> None:
    tokens, at = 17, 9  # the watched token among 16 others, sharing its experts' blocks with them
    x = torch.randn(tokens, HIDDEN).to(dtype)
    ids, weights = _routing(tokens, TOP_K, EXPERTS)
    w_gate_up, w_down = _weights(EXPERTS, HIDDEN, INTER, dtype)
    batched = moe_experts(x, ids, weights, w_gate_up, w_down, "silu")
    alone = moe_experts(x[at : at + 1], ids[at : at + 1], weights[at : at + 1], w_gate_up, w_down, "silu")
    assert torch.equal(alone[0], batched[at])


def test_no_tokens_give_an_empty_output() -> None:
    out = moe_experts(torch.randn(0, HIDDEN), torch.zeros(0, TOP_K, dtype=torch.long), torch.zeros(0, TOP_K),
                      *_weights(EXPERTS, HIDDEN, INTER, torch.float32), "silu")  # fmt: skip
    assert out.shape == (0, HIDDEN)


def test_align_groups_every_pair_once_by_expert_in_padded_blocks() -> None:
    ids = torch.tensor([[4, 0], [4, 4], [0, 2], [4, 2]])
    sorted_pairs, block_expert = _align_by_expert(ids, EXPERTS)
    pairs = ids.numel()
    assert len(sorted_pairs) == len(block_expert) * BLOCK_M
    # Experts 0, 2 and 4 have pairs: a block each, in expert order; the rest of the worst-case grid is idle.
    assert block_expert.tolist() == [0, 2, 4] + [EXPERTS] * (len(block_expert) - 3)
    blocks = sorted_pairs.view(-1, BLOCK_M)
    assert blocks[0, :2].tolist() == [1, 4] and blocks[1, :2].tolist() == [5, 7]
    assert blocks[2, :4].tolist() == [0, 2, 3, 6]  # pair order within an expert
    assert int((sorted_pairs < pairs).sum()) == pairs and (sorted_pairs[sorted_pairs >= pairs] == pairs).all()


def test_pairs_of_another_rank_s_experts_contribute_nothing() -> None:
    """Expert parallelism: each rank's experts, with the others' pairs marked -1, sum to the whole layer."""
    x = torch.randn(9, HIDDEN)
    ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(9)])
    weights = torch.rand(9, TOP_K)
    w_gate_up, w_down = _weights(EXPERTS, HIDDEN, INTER, torch.float32)
    first = 2  # this rank holds experts [0, 2), the other [2, EXPERTS)
    mine = ids.masked_fill(ids >= first, -1)
    theirs = torch.where(ids >= first, ids - first, -1)
    _check(x, mine, weights, w_gate_up[:first], w_down[:first], "silu")
    with poisoned_allocations():
        parts = moe_experts(x, mine, weights, w_gate_up[:first], w_down[:first], "silu") + moe_experts(
            x, theirs, weights, w_gate_up[first:], w_down[first:], "silu"
        )
    assert relative_error(parts, reference.moe_experts(x, ids, weights, w_gate_up, w_down, "silu")) < 1e-6
    nothing = moe_experts(x, torch.full_like(ids, -1), weights, w_gate_up, w_down, "silu")
    assert torch.equal(nothing, torch.zeros_like(x))


@pytest.mark.parametrize("bad", [EXPERTS, -2])
def test_an_expert_id_out_of_range_is_refused(bad: int) -> None:
    ids = torch.tensor([[0, bad]])
    with pytest.raises(IndexError):
        moe_experts(
            torch.randn(1, HIDDEN), ids, torch.rand(1, 2), *_weights(EXPERTS, HIDDEN, INTER, torch.float32), "silu"
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"activation": "relu"}, "activation must be one of"),
        ({"topk_ids": torch.zeros(3, TOP_K)}, "topk_ids must be one of"),
        ({"topk_weights": torch.rand(3, TOP_K + 1)}, "must match topk_ids"),
        ({"topk_ids": torch.zeros(2, TOP_K, dtype=torch.long)}, "for x's tokens"),
        ({"w_down": torch.zeros(EXPERTS, HIDDEN, INTER + 1)}, "w_down"),
        ({"w_gate_up": torch.zeros(EXPERTS, 2 * INTER, HIDDEN + 1)}, "w_gate_up"),
        ({"w_down": torch.zeros(EXPERTS, HIDDEN, INTER, dtype=torch.float16)}, "must share a dtype"),
    ],
)
def test_bad_arguments_are_refused(change: dict, message: str) -> None:
    w_gate_up, w_down = _weights(EXPERTS, HIDDEN, INTER, torch.float32)
    args = {
        "x": torch.randn(3, HIDDEN),
        "topk_ids": torch.zeros(3, TOP_K, dtype=torch.long),
        "topk_weights": torch.rand(3, TOP_K),
        "w_gate_up": w_gate_up,
        "w_down": w_down,
        "activation": "silu",
    }
    args |= change
    with pytest.raises(ValueError, match=message):
        moe_experts(**args)
