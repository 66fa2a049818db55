"""The one checksum a KV block carries: in RAM, on disk and on the wire.

Its job is integrity only — catching bit flips, truncation and torn writes;
a block's *name* is its chained hash from ``kvmesh.blocks``. CRC-32 does that
job (it detects every burst error up to 32 bits and all odd-bit errors) at
well over 1 GB/s, about twice blake2b's speed here, which matters because
every KV transfer checksums each byte on both ends. zlib releases the GIL
on large buffers, so a checksum overlaps other threads' work.
"""

from __future__ import annotations

import zlib

CHECKSUM_BYTES = 4


class Crc32:
    """An incremental checksum, for data that arrives in pieces (streamed chunks)."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(CHECKSUM_BYTES, "little")


def new_hasher() -> Crc32:
    return Crc32()


def checksum(data: bytes | memoryview) -> bytes:
    return zlib.crc32(data).to_bytes(CHECKSUM_BYTES, "little")
