"""The native CPU kernels for the tests that check them: loaded, or the test skipped with the reason.

They need AVX-512; on a CPU without it each test of theirs is skipped saying so, and the torch
references they fall back to are what the rest of the suite runs (the fallback itself is tested).
"""

from __future__ import annotations

import pytest

from kernels import cpu
from kernels.errors import KernelUnavailable


def native_cpu_kernels() -> None:
    try:
        cpu.load()
    except KernelUnavailable as e:
        pytest.skip(str(e))
