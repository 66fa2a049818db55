"""bench/peers.py's arithmetic: medians of the repeats, the table's rows, the ratios the issue judges, output agreement.

Pure (no peers, no I/O), so tests/bench can check it. A measurement is a ``Sample``: one engine x precision,
one column, one repeat.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ENGINES = ("kvmesh", "vllm", "llamacpp")
PRECISIONS = ("fp32", "bf16", "int8", "q4_1")
# Which precisions each engine has a row for. fp32/bf16: the checkpoint's floats. int8: 8-bit weights, bf16 activations
# (kvmesh --quantization int8: one scale per output channel; llama.cpp's Q8_0: one fp16 scale per 32 weights).
# Q4_1 is llama.cpp's own.
ROWS = {"kvmesh": ("fp32", "bf16", "int8"), "vllm": ("fp32", "bf16"), "llamacpp": ("fp32", "bf16", "int8", "q4_1")}
COLUMNS = ("inproc_16", "inproc_1", "http_16", "http_1")
SAME_PRECISION = ("fp32", "bf16")  # the rows every engine has
LLAMACPP_SAME_PRECISION = ("fp32", "bf16", "int8")  # the rows kvmesh and llama.cpp share


@dataclass(frozen=True)
class Sample:
    engine: str
    precision: str
    column: str  # a COLUMNS entry
    tokens_per_s: float
    ttft_s: float | None = None  # HTTP columns: mean time to first token over the streams


def medians(samples: Iterable[Sample]) -> dict[tuple[str, str, str], dict[str, float | None]]:
    """(engine, precision, column) -> median tok/s (and median of the mean TTFTs) over the repeats."""
    groups: dict[tuple[str, str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.engine, s.precision, s.column), []).append(s)
    out: dict[tuple[str, str, str], dict[str, float | None]] = {}
    for key, group in groups.items():
        ttfts = [s.ttft_s for s in group if s.ttft_s is not None]
        out[key] = {
            "tokens_per_s": statistics.median(s.tokens_per_s for s in group),
            "ttft_s": statistics.median(ttfts) if ttfts else None,
            "repeats": len(group),
        }
    return out


def _rate(table: dict, engine: str, precision: str, column: str) -> float | None:
    cell = table.get((engine, precision, column))
    return None if cell is None else cell["tokens_per_s"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _best(table: dict, engine: str, column: str, precisions: Sequence[str] = SAME_PRECISION) -> float | None:
    rates = [r for p in precisions if (r := _rate(table, engine, p, column)) is not None]
    return max(rates) if rates else None


def ratios(table: dict) -> dict[str, float | None]:
    """The issue's ratios (>= 1.0 is its bar for the first two kinds, >= 0.8 for the last); None where a row
    is missing."""
    out: dict[str, float | None] = {}
    for column, label in (("inproc_16", "in-process 16"), ("http_16", "HTTP 16")):
        for p in SAME_PRECISION:
            out[f"kvmesh/vllm {label} {p}"] = _ratio(_rate(table, "kvmesh", p, column), _rate(table, "vllm", p, column))
        out[f"kvmesh/vllm {label} best"] = _ratio(_best(table, "kvmesh", column), _best(table, "vllm", column))
    for p in LLAMACPP_SAME_PRECISION:
        out[f"kvmesh/llamacpp in-process 1 {p}"] = _ratio(
            _rate(table, "kvmesh", p, "inproc_1"), _rate(table, "llamacpp", p, "inproc_1")
        )
    out["kvmesh/llamacpp in-process 1 best"] = _ratio(
        _best(table, "kvmesh", "inproc_1"), _best(table, "llamacpp", "inproc_1")
    )
    kvmesh_any = _best(table, "kvmesh", "inproc_1", ROWS["kvmesh"])
    out["kvmesh best/llamacpp q4_1 in-process 1"] = _ratio(kvmesh_any, _rate(table, "llamacpp", "q4_1", "inproc_1"))
    out["kvmesh best/llamacpp best, any precision, in-process 1"] = _ratio(
        kvmesh_any, _best(table, "llamacpp", "inproc_1", ROWS["llamacpp"])
    )
    for p in ROWS["kvmesh"]:
        out[f"kvmesh HTTP 1 / in-process 1 {p}"] = _ratio(
            _rate(table, "kvmesh", p, "http_1"), _rate(table, "kvmesh", p, "inproc_1")
        )
    return out


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> str:
    """How many of the sequences are token-for-token identical, as "k/n"."""
    return f"{sum(list(a) == list(b) for a, b in zip(reference, other))}/{len(reference)}"


def table_rows(table: dict) -> list[list[str]]:
    """One text row per engine x precision measured, in ENGINES x PRECISIONS order."""

    def rate(key: tuple[str, str, str]) -> str:
        cell = table.get(key)
        if cell is None:
            return "-"
        ttft = f" ({cell['ttft_s']:.2f} s)" if cell["ttft_s"] is not None and key[2] == "http_16" else ""
        return f"{cell['tokens_per_s']:.1f}{ttft}"

    rows = []
    for e in ENGINES:
        for p in ROWS[e]:
            if any((e, p, c) in table for c in COLUMNS):
                rows.append([e, p, *(rate((e, p, c)) for c in COLUMNS)])
    return rows
