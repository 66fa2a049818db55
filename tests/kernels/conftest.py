"""Kernel tests: the Triton kernels run in Triton's interpreter on CPU.

Triton chooses between compiling and interpreting when a kernel is *defined*, so
TRITON_INTERPRET=1 is set before ``kernels.triton`` is imported. It is then put
back as it was, so the engine tests sharing this pytest process keep the torch
references, and set again around each kernel test (the dispatcher reads it per call).
"""

from __future__ import annotations

import os

_previous = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import kernels.triton  # noqa: E402, F401  (defines the kernels, interpreted)

if _previous is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _previous

import random  # noqa: E402
import secrets  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels.triton.rms_norm import _rms_norm_kernel  # noqa: E402

if not isinstance(_rms_norm_kernel, InterpretedFunction):
    raise RuntimeError("kernels.triton was imported before TRITON_INTERPRET=1 was set: its kernels are compiled")


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def fresh_seed() -> Iterator[int]:
    """Fresh random inputs for every test; the seed is printed so a failure can be replayed."""
    seed = secrets.randbits(31)
    print(f"torch seed {seed}")
    torch.manual_seed(seed)
    random.seed(seed)
    yield seed
