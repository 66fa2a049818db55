"""The CPU ops deterministic serving runs (``Ops(cpu, batch_invariant=True)``): a row's result is the
same bits whatever rows share its call. The native invariant product against the library's, which
does depend on them; the references' row-wise ops, which deterministic serving relies on; and the
extend attention whose every row is a decode, the same for a prompt whole, chunked, or over a
cached prefix."""

from __future__ import annotations

import pytest
import torch

from kernels import Ops, reference
from tests.kernels.native import native_cpu_kernels
from tests.kernels.paged import random_paged_kv

CPU = torch.device("cpu")
ROW_COUNTS = [1, 2, 5, 6, 7, 16, 47, 48, 49, 130]  # around the kernel's 6-row passes and 48-row chunks
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops() -> Ops:
    native_cpu_kernels()
    return Ops(CPU, batch_invariant=True)


def _rows_alone_equal(fn, x: torch.Tensor) -> list[int]:
    """The rows of ``fn(x)`` that differ from ``fn`` of that row alone."""
    together = fn(x)
    return [i for i in range(len(x)) if not torch.equal(fn(x[i : i + 1].clone()), together[i : i + 1])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_invariant_product_of_a_row_is_the_same_in_any_batch(ops, dtype) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 320, dtype=dtype), torch.randn(200, dtype=dtype)
    library_moved = 0
    for rows in ROW_COUNTS:
        x = torch.randn(rows, 320, dtype=dtype)
        assert _rows_alone_equal(lambda t: torch.ops.kvmesh_cpu.invariant_mm(t, weight, bias), x) == []
        got = torch.ops.kvmesh_cpu.invariant_mm(x, weight, bias).float()
        want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        assert torch.allclose(
            got, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-1 if dtype == torch.bfloat16 else 1e-4
        )
        library_moved += len(_rows_alone_equal(lambda t: torch.nn.functional.linear(t, weight, bias), x))
    # What the kernel is for: the library's product does round rows by their batch (were this ever 0 on
    # some build, the invariant kernel would still be right; this only shows the test can see a difference).
    assert library_moved > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_s_experts_give_it_the_same_bits_in_any_batch(ops, dtype) -> None:
    """The batch-invariant moe_experts: a token alone, and among tokens that share its experts (an expert's
    rows are one product, so the library's would round them by how many there are)."""
    torch.manual_seed(0)
    experts, hidden, inter = 6, 96, 80
    w_gate_up = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
    x = torch.randn(49, hidden, dtype=dtype)
    ids = torch.stack([torch.randperm(experts)[:2] for _ in range(49)])
    weights = torch.rand(49, 2)
    together = ops.moe_experts(x, ids, weights, w_gate_up, w_down, "silu")
    for i in range(49):
        alone = ops.moe_experts(x[i : i + 1].clone(), ids[i : i + 1], weights[i : i + 1], w_gate_up, w_down, "silu")
        assert torch.equal(alone, together[i : i + 1]), i
    ref = reference.moe_experts(x.float(), ids, weights, w_gate_up.float(), w_down.float(), "silu")
    assert torch.allclose(together.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_row_wise_ops_deterministic_serving_keeps_from_the_references_are_row_invariant(ops, dtype) -> None:
    torch.manual_seed(1)
    norm = torch.randn(576, dtype=dtype)
    assert ops.rms_norm is reference.rms_norm and ops.silu_and_mul is reference.silu_and_mul
    for rows in [*ROW_COUNTS, 600]:  # 600 rows: TensorIterator splits the work over threads
        x, r = torch.randn(rows, 576, dtype=dtype), torch.randn(rows, 576, dtype=dtype)
        assert _rows_alone_equal(lambda t: ops.rms_norm(t, norm, 1e-5), x) == []
        both = torch.cat([x, r], dim=1)
        assert (
            _rows_alone_equal(lambda t: torch.cat(ops.fused_add_rms_norm(t[:, :576], t[:, 576:], norm, 1e-5), 1), both)
            == []
        )
        gate_up = torch.randn(rows, 2 * 1536, dtype=dtype) * 4
        assert _rows_alone_equal(ops.silu_and_mul, gate_up) == []
    logits = torch.randn(5, 49152) * 6  # the sampler's log-softmax over a vocabulary, per sequence's rows
    assert _rows_alone_equal(lambda t: torch.log_softmax(t, dim=-1), logits) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_attention_gives_a_token_the_same_bits_whole_chunked_or_over_a_cached_prefix(ops, dtype) -> None:
    torch.manual_seed(2)
    n, heads, kv_heads, dim = 150, 8, 2, 64
    kv = random_paged_kv([n], kv_heads, dim, dtype)
    q = torch.randn(n, heads, dim, dtype=dtype)

    def extend(first: int, last: int) -> torch.Tensor:
        """Rows first..last-1 as one step over the cache's first ``last`` tokens."""
        qsl = torch.tensor([0, last - first], dtype=torch.int32)
        return ops.paged_extend_attention(
            q[first:last], kv.k_cache, kv.v_cache, kv.block_tables, qsl, torch.tensor([last], dtype=torch.int32), 0.125
        )

    whole = extend(0, n)
    chunked = torch.cat([extend(a, min(a + 37, n)) for a in range(0, n, 37)])
    tail = extend(100, n)  # a prefix of 100 tokens cached
    as_decodes = torch.cat([extend(i, i + 1) for i in range(n)])
    assert torch.equal(chunked, whole) and torch.equal(tail, whole[100:]) and torch.equal(as_decodes, whole)
    want = reference.paged_extend_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        0.125,
    )
    assert torch.allclose(whole.float(), want.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
