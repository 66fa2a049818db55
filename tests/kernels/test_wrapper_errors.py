"""The wrappers refuse bad arguments with a ValueError that says what is wrong."""

from __future__ import annotations

import pytest
import torch

from kernels.triton.decode_attention import paged_decode_attention
from kernels.triton.extend_attention import paged_extend_attention
from kernels.triton.fp8 import fp8_scaled_mm
from kernels.triton.kv_write import write_kv_cache
from kernels.triton.rms_norm import fused_add_rms_norm, rms_norm
from kernels.triton.rotary import rotary_embedding
from kernels.triton.silu_mul import silu_and_mul

CACHE = torch.zeros(4, 16, 2, 64)
TABLES = torch.zeros(3, 4, dtype=torch.int32)
LENS = torch.ones(3, dtype=torch.int32)


def test_rms_norm() -> None:
    with pytest.raises(ValueError, match="weight has 32 elements"):
        rms_norm(torch.randn(4, 64), torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="x must be one of"):
        rms_norm(torch.ones(4, 64, dtype=torch.int32), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm(torch.randn(64, 4).t(), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        fused_add_rms_norm(torch.randn(4, 64), torch.randn(3, 64), torch.ones(64), 1e-6)


def test_silu_and_mul() -> None:
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.randn(3, 7))


def test_rotary_embedding() -> None:
    q, k, cache = torch.randn(5, 4, 64), torch.randn(5, 2, 64), torch.randn(100, 64)
    with pytest.raises(ValueError, match="positions must be one of"):
        rotary_embedding(torch.zeros(5), q, k, cache)
    with pytest.raises(ValueError, match="positions has 4 entries for 5 tokens"):
        rotary_embedding(torch.zeros(4, dtype=torch.long), q, k, cache)
    with pytest.raises(ValueError, match="cos_sin_cache rows have 32 values"):
        rotary_embedding(torch.zeros(5, dtype=torch.long), q, k, torch.randn(100, 32))


def test_write_kv_cache() -> None:
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="cache heads/dim"):
        write_kv_cache(k, k, torch.zeros(4, 16, 1, 64), torch.zeros(4, 16, 1, 64), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping must be one of"):
        write_kv_cache(k, k, CACHE, CACHE, torch.zeros(3))


def test_decode_attention() -> None:
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4 KV heads"):
        paged_decode_attention(torch.randn(3, 6, 64), torch.zeros(4, 16, 4, 64), torch.zeros(4, 16, 4, 64),
                               TABLES, LENS, 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="cache head_dim 64 differs from q's 128"):
        paged_decode_attention(torch.randn(3, 4, 128), CACHE, CACHE, TABLES, LENS, 0.1)
    with pytest.raises(ValueError, match="must share one dtype"):
        paged_decode_attention(torch.randn(3, 4, 64).half(), CACHE, CACHE, TABLES, LENS, 0.1)
    with pytest.raises(ValueError, match="seq_lens has 2 entries for 3 sequences"):
        paged_decode_attention(torch.randn(3, 4, 64), CACHE, CACHE, TABLES, LENS[:2], 0.1)
    with pytest.raises(ValueError, match="block_tables must be one of"):
        paged_decode_attention(torch.randn(3, 4, 64), CACHE, CACHE, TABLES.float(), LENS, 0.1)
    for window in (-1, 2.0, True, None):
        with pytest.raises(ValueError, match="window must be an int >= 0"):
            paged_decode_attention(torch.randn(3, 4, 64), CACHE, CACHE, TABLES, LENS, 0.1, window)


def test_extend_attention() -> None:
    q = torch.randn(10, 4, 64)
    with pytest.raises(ValueError, match="block_tables has 3 rows for 2 sequences"):
        paged_extend_attention(q, CACHE, CACHE, TABLES, torch.tensor([0, 5, 10]), LENS[:2], 0.1)
    with pytest.raises(ValueError, match="query_start_loc must have 1 dims"):
        paged_extend_attention(q, CACHE, CACHE, TABLES, torch.zeros(4, 1, dtype=torch.long), LENS, 0.1)
    for window in (-1, 2.0, True, None):
        with pytest.raises(ValueError, match="window must be an int >= 0"):
            paged_extend_attention(q, CACHE, CACHE, TABLES, torch.tensor([0, 5, 10, 10]), LENS, 0.1, window)


def test_fp8_scaled_mm() -> None:
    w = torch.zeros(8, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="qweight must be one of"):
        fp8_scaled_mm(torch.randn(2, 16), w.float(), torch.ones(8))
    with pytest.raises(ValueError, match="qweight has 16 input channels, x has 12"):
        fp8_scaled_mm(torch.randn(2, 12), w, torch.ones(8))
    with pytest.raises(ValueError, match="scale has 4 entries for 8 output channels"):
        fp8_scaled_mm(torch.randn(2, 16), w, torch.ones(4))
