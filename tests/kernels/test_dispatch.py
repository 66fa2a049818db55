"""The dispatcher picks the Triton kernels under TRITON_INTERPRET=1 and the references on plain CPU."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import kernels.triton
from kernels import Ops, dispatch, get_op, reference
from kernels.dispatch import OPS

CPU = torch.device("cpu")


def test_every_op_has_a_triton_kernel_and_a_reference() -> None:
    assert set(kernels.triton.KERNELS) == set(OPS)
    assert all(callable(getattr(reference, name)) for name in OPS)


def test_interpreter_picks_triton() -> None:  # the conftest sets TRITON_INTERPRET=1 for these tests
    for name in OPS:
        assert get_op(name, CPU) is kernels.triton.KERNELS[name]
    assert Ops(CPU).paged_decode_attention is kernels.triton.KERNELS["paged_decode_attention"]


def test_plain_cpu_picks_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(dispatch, "_CPU_NATIVE", {})  # as before kernels.cpu.load()
    for name in OPS:
        assert get_op(name, CPU) is getattr(reference, name)
    assert Ops(CPU).rms_norm is reference.rms_norm


def test_a_native_cpu_kernel_is_picked_on_plain_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def native(*args):
        return None

    monkeypatch.setattr(dispatch, "_CPU_NATIVE", {})
    dispatch.register_cpu_native("int8_scaled_mm", native)
    assert get_op("int8_scaled_mm", CPU) is kernels.triton.KERNELS["int8_scaled_mm"]  # the interpreter's tests
    monkeypatch.delenv("TRITON_INTERPRET")
    assert get_op("int8_scaled_mm", CPU) is native
    assert get_op("rms_norm", CPU) is reference.rms_norm
    with pytest.raises(KeyError, match="unknown op"):
        dispatch.register_cpu_native("int4_mm", native)


def test_unknown_op() -> None:
    with pytest.raises(KeyError, match="unknown op"):
        get_op("flash_mla", CPU)


def test_a_failing_triton_import_leaves_the_references(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "kernels.triton", None)  # makes `import kernels.triton` raise
    monkeypatch.setattr(dispatch, "_TRITON", {})
    monkeypatch.setattr(dispatch, "_triton_import_tried", False)
    monkeypatch.setattr(dispatch, "_CPU_NATIVE", {})  # what is left is the references
    monkeypatch.setattr(dispatch, "_load_cpu_native", lambda: None)
    with caplog.at_level(logging.WARNING, logger="kernels.dispatch"):
        assert Ops(CPU).paged_extend_attention is reference.paged_extend_attention
    assert "Triton kernels unavailable" in caplog.text
