"""A stored KV block: opaque payload bytes plus what the engine needs to read them.

The tensor wire format is the engine's business (``kvmesh.engine.kv_cache``);
the store only keeps ``shape`` and ``dtype`` next to the bytes and guards the
bytes with a checksum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.checksum import CHECKSUM_BYTES, checksum
from kvmesh.errors import InvalidArgument

MAX_DTYPE_CHARS = 32
MAX_RANK = 16


@dataclass(frozen=True, slots=True)
class Block:
    """``checksum`` must be the checksum of ``data``: build with ``Block.build``,
    or pass a checksum that was verified against the data (the chunk reassembler
    does that)."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str
    checksum: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes):
            raise InvalidArgument(f"block data must be bytes, got {type(self.data).__name__}")
        if len(self.shape) > MAX_RANK or not all(isinstance(d, int) and d >= 0 for d in self.shape):
            raise InvalidArgument(f"block shape must be at most {MAX_RANK} non-negative ints, got {self.shape!r}")
        if not isinstance(self.dtype, str) or not 0 < len(self.dtype) <= MAX_DTYPE_CHARS:
            raise InvalidArgument(f"block dtype must be a non-empty name, got {self.dtype!r}")
        if len(self.checksum) != CHECKSUM_BYTES:
            raise InvalidArgument(f"block checksum must be {CHECKSUM_BYTES} bytes, got {len(self.checksum)}")

    @classmethod
    def build(cls, data: bytes | bytearray | memoryview, shape: Sequence[int], dtype: str) -> Block:
        data = bytes(data)  # an immutable copy: nobody can change a stored block under us
        return cls(data, tuple(shape), dtype, checksum(data))

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def is_intact(self) -> bool:
        return checksum(self.data) == self.checksum
