"""bench/roofline.py's accounting of what one decode step reads and multiplies, 8-bit layers included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from roofline import linear_shapes, weight_bytes  # noqa: E402

from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from tests.engine.conftest import write_checkpoint  # noqa: E402


@pytest.mark.native_cpu
@pytest.mark.parametrize("head", [False, True])
def test_int8_weights_count_one_byte_and_the_head_once(tmp_path, head):
    path = write_checkpoint(tmp_path / "m", "qwen3-qknorm-tied")  # tied: the embedding is the head
    # Plain nn.Linear projections (no small-row copies) to count the reference from.
    plain = LLMEngine(path, EngineConfig(num_blocks=16, small_rows_linears=False)).model
    int8 = LLMEngine(path, EngineConfig(num_blocks=16, quantization="int8", quantize_lm_head=head)).model
    assert sorted(linear_shapes(int8)) == sorted(linear_shapes(plain))  # same products, one LM head
    embedding = plain.embed_tokens.weight
    projections = sum(m.weight.numel() for m in plain.modules() if type(m).__name__ == "Linear")
    others = sum(p.numel() * 4 for p in plain.parameters()) - projections * 4 - embedding.numel() * 4
    out_channels = sum(n for _, n in linear_shapes(plain)) - embedding.shape[0]  # one float32 scale each
    expected = others + projections + out_channels * 4
    # The head reads the embedding in float32, or its int8 copy (the lookup reads a few rows only).
    expected += embedding.numel() + embedding.shape[0] * 4 if head else embedding.numel() * 4
    assert weight_bytes(int8) == expected
