"""The compile cache keeps graphs apart that the small-row linears' calibration shaped differently.

The calibration is a timing, so two starts of one worker on one machine can stream different row counts,
and the few-rows graph's range follows it. Cached under one key, the graph of 2 to 3 rows came back to a
start that marked 2 to 5 with the guards of 3 (ConstraintViolationError: the decode worker failed to start).
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine

pytestmark = pytest.mark.slow


@pytest.mark.native_cpu
def test_a_start_that_streams_other_rows_compiles_its_own_graphs(checkpoints, monkeypatch, tmp_path):
    from kernels import small_rows_linear

    monkeypatch.setenv("KVMESH_COMPILE_CACHE", str(tmp_path))
    for streamed in (3, 5):
        monkeypatch.setattr(small_rows_linear, "most_rows_that_stream", lambda *_, s=streamed, **__: s)
        torch._dynamo.reset()  # a new start: nothing compiled in this process counts
        engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64, compile=True))
        assert engine.model.compiled_decode.few_rows == streamed
        engine.close()
    assert len(list(tmp_path.iterdir())) == 2  # a folder each
