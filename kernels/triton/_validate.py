"""Argument checks shared by the Triton wrappers: each failure is a ValueError that names the argument."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_tensor(
    name: str, t: torch.Tensor, ndim: int | tuple[int, ...], dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> None:
    """``t`` has one of the allowed ranks and dtypes, and a unit stride in its last dimension
    (the kernels index the last dimension as a contiguous vector)."""
    require(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    ranks = (ndim,) if isinstance(ndim, int) else ndim
    require(t.dim() in ranks, f"{name} must have {' or '.join(map(str, ranks))} dims, got shape {tuple(t.shape)}")
    require(t.dtype in dtypes, f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    require(t.numel() == 0 or t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    require(len(set(devices.values())) == 1, f"tensors must share one device, got {devices}")
