"""The one op dispatcher: every model op goes through here.

Today every op resolves to its plain-torch reference (``kernels.reference``).
Triton kernels with identical signatures register themselves per op and are
picked when the tensors live on CUDA (or when ``TRITON_INTERPRET=1`` asks for
the interpreter in tests).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from kernels import reference

OPS = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "write_kv_cache",
    "paged_decode_attention",
    "paged_extend_attention",
)

# op name -> Triton implementation, filled by kernels.triton modules as they land.
_TRITON: dict[str, Callable[..., Any]] = {}


def register_triton(name: str, fn: Callable[..., Any]) -> None:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}")
    _TRITON[name] = fn


def use_triton(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def get_op(name: str, device: torch.device) -> Callable[..., Any]:
    """The implementation of ``name`` for tensors on ``device``."""
    if use_triton(device) and name in _TRITON:
        return _TRITON[name]
    return getattr(reference, name)


class Ops:
    """The ops resolved once for one device, so the hot path does no lookups."""

    def __init__(self, device: torch.device) -> None:
        for name in OPS:
            setattr(self, name, get_op(name, device))
