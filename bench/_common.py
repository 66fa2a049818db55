"""Helpers the router benchmarks share: a percentile, number cells, the JSON file."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def cells(row: Sequence[object]) -> list[str]:
    """A table row as text, floats to three decimals."""
    return [f"{c:.3f}" if isinstance(c, float) else str(c) for c in row]


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {path}")
