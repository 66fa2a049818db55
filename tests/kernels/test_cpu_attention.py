"""The native CPU decode attention (kernels/cpu, built on first use) against the reference; its
batch invariance; the extend attention whose decode rows go through it, bitwise equal to the
decodes they stand for; its tracing by torch.compile; and the engine's ops picking it (or, where
it cannot run, keeping the references with a warning)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from kernels import Ops, cpu, dispatch, reference
from kernels.cpu.extend_attention import paged_extend_attention as native_extend
from kernels.errors import KernelUnavailable
from kernels.triton.testing import relative_error
from tests.kernels.native import native_cpu_kernels
from tests.kernels.paged import random_paged_kv

CPU = torch.device("cpu")
# Edge lengths: one token, one block, a block + 1, lengths past a 16-wide vector of scores.
EDGE_LENS = [1, 16, 17, 31, 200, 1100]


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch):
    """The native op, as CPU ops pick it (outside the interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    native_cpu_kernels()
    op = Ops(CPU).paged_decode_attention
    assert op is torch.ops.kvmesh_cpu.paged_decode_attention
    return op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (2, 4, 128), (4, 1, 80), (1, 8, 40)])
def test_native_decode_matches_reference(
    native, dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int
) -> None:
    random.seed(head_dim)
    seq_lens = EDGE_LENS + [random.randint(2, 700) for _ in range(3)]
    kv = random_paged_kv(seq_lens, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype)
    out = native(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
    exact = reference.paged_decode_attention(
        q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, kv.seq_lens, head_dim**-0.5
    )
    assert out.shape == q.shape and out.dtype == dtype
    # float32: summation order and exp's last bit; 16 bits: the output's rounding.
    assert relative_error(out, exact) < {torch.float32: 1e-6, torch.bfloat16: 5e-3, torch.float16: 1e-3}[dtype]


def test_native_decode_takes_int64_metadata_and_a_strided_query(native) -> None:
    kv = random_paged_kv([33, 300], 2, 64, torch.float32)
    q = torch.randn(2, 8, 80)[:, :, :64]
    out = native(q, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.seq_lens.long(), 0.125)
    ref = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    assert relative_error(out, ref) < 1e-6


def test_native_decode_rows_do_not_depend_on_their_batch(native) -> None:
    """Each sequence gets bit for bit what it gets alone, whatever else shares the call."""
    torch.manual_seed(0)
    kv = random_paged_kv([5, 64, 200, 700, 90], 3, 64, torch.bfloat16)
    q = torch.randn(5, 9, 64, dtype=torch.bfloat16)
    together = native(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    for i in range(5):
        alone = native(q[i : i + 1], kv.k_cache, kv.v_cache, kv.block_tables[i : i + 1], kv.seq_lens[i : i + 1], 0.125)
        assert torch.equal(together[i], alone[0]), f"sequence {i}"


def test_native_decode_refuses_what_it_cannot_read(native) -> None:
    kv = random_paged_kv([20], 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="cannot share 2 KV heads"):
        native(torch.randn(1, 3, 64), kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="head_dim 32 \\(cache 64\\) must match"):
        native(torch.randn(1, 4, 32), kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    too_long = torch.tensor([kv.block_tables.shape[1] * 16 + 1])
    with pytest.raises(RuntimeError, match="is outside 1\\.\\."):
        native(torch.randn(1, 4, 64), kv.k_cache, kv.v_cache, kv.block_tables, too_long, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_extend_rows_attend_as_their_native_decodes(native, dtype: torch.dtype) -> None:
    """Decode rows sharing a prefill's step and (below float32) a verify's rows are bitwise the
    native decode of their token; a prefill chunk keeps the reference's masked call."""
    torch.manual_seed(0)
    as_decodes = reference.DECODE_ROWS_MAX if dtype != torch.float32 else 1
    new = [5, 1, 3, reference.DECODE_ROWS_MAX, 40, 1, 5]
    prefix = [37, 80, 16, 5, 20, 7, 100]
    kv = random_paged_kv([p + n for p, n in zip(prefix, new)], 3, 64, dtype)
    starts = [0] + torch.tensor(new).cumsum(0).tolist()
    q = torch.randn(starts[-1], 9, 64).to(dtype)
    got = native_extend(q, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor(starts), kv.seq_lens, 0.125)
    want = reference.paged_extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor(starts), kv.seq_lens, 0.125
    )
    assert relative_error(got, want) < {torch.float32: 1e-6, torch.bfloat16: 5e-3}[dtype]
    for i, (p, n) in enumerate(zip(prefix, new)):
        if n > as_decodes:
            continue
        for j in range(n):
            row = starts[i] + j
            decode = native(
                q[row : row + 1], kv.k_cache, kv.v_cache, kv.block_tables[i : i + 1], torch.tensor([p + j + 1]), 0.125
            )
            assert torch.equal(got[row], decode[0]), f"sequence {i}, row {j}"


def test_native_decode_under_torch_compile(native) -> None:
    kv = random_paged_kv([40, 9], 3, 64, torch.float32)

    def attend(q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return native(q * 2, kv.k_cache, kv.v_cache, tables, lens, 0.125) + 1

    compiled = torch.compile(attend, dynamic=True, fullgraph=True)
    for rows in (2, 1):
        q = torch.randn(rows, 9, 64)
        assert torch.equal(
            compiled(q, kv.block_tables[:rows], kv.seq_lens[:rows]),
            attend(q, kv.block_tables[:rows], kv.seq_lens[:rows]),
        )


def test_cpu_ops_keep_the_references_where_the_kernels_cannot_load(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cpu, "_loaded", False)
    monkeypatch.setattr(cpu, "_failure", "they need AVX-512 (torch reports AVX2 on this CPU)")
    monkeypatch.setattr(dispatch, "_CPU_NATIVE", {})
    monkeypatch.setattr(dispatch, "_cpu_native_warned", False)
    with caplog.at_level(logging.WARNING, logger="kernels.dispatch"):
        ops = Ops(CPU)
        Ops(CPU)
    assert ops.paged_decode_attention is reference.paged_decode_attention
    assert ops.paged_extend_attention is reference.paged_extend_attention
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "kvmesh's native CPU kernels are unavailable: they need AVX-512 (torch reports AVX2 on "
        "this CPU); CPU models run the torch references"
    ]
    with pytest.raises(KernelUnavailable):
        cpu.load()
