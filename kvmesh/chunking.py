"""Cutting a block into stream chunks and putting it back together.

gRPC caps a message at 4 MiB by default and a KV block can be bigger, so Put
(client streaming) and Get (server streaming) carry a block as numbered chunks.
Every chunk repeats ``count`` and ``total_bytes`` so the receiver can check each
one as it arrives; the block's checksum, sent once beside them, is verified
over the reassembled bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvmesh.checksum import new_hasher
from kvmesh.errors import InvalidArgument, ResourceExhausted

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: a quarter of gRPC's default message cap, with room for framing


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    count: int
    total_bytes: int
    data: bytes


def split(data: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
    """Chunks of at most ``chunk_bytes``, in order; an empty block is one empty chunk."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    total = len(data)
    count = max(1, -(-total // chunk_bytes))
    if count == 1 and isinstance(data, bytes):
        yield Chunk(0, 1, total, data)  # immutable and whole: shared, not copied
        return
    view = memoryview(data)
    for index in range(count):
        yield Chunk(index, count, total, bytes(view[index * chunk_bytes : (index + 1) * chunk_bytes]))


class Reassembler:
    """Rebuilds one block from its chunks; raises ``InvalidArgument`` on any
    malformed stream (out of order, inconsistent count or size, missing chunks,
    checksum mismatch) and ``ResourceExhausted`` on a block over ``max_bytes``
    before buffering any of it.

    ``verify=False`` leaves the checksum to the caller, who checks it before using
    the bytes — e.g. on a worker thread, so it does not hold up the receiving loop."""

    def __init__(self, checksum: bytes, max_bytes: int | None = None, verify: bool = True) -> None:
        self._checksum = checksum
        self._max_bytes = max_bytes
        self._hasher = new_hasher() if verify else None
        self._parts: list[bytes] = []
        self._received_bytes = 0
        self._count: int | None = None
        self._total_bytes = 0

    def add(self, chunk: Chunk) -> None:
        if self._count is None:
            self._start(chunk)
        elif (chunk.count, chunk.total_bytes) != (self._count, self._total_bytes):
            raise InvalidArgument(
                f"chunk {chunk.index} says {chunk.count} chunks / {chunk.total_bytes} bytes, "
                f"the stream began with {self._count} / {self._total_bytes}"
            )
        if chunk.index != len(self._parts):
            raise InvalidArgument(f"chunk {chunk.index} arrived where chunk {len(self._parts)} was due")
        if chunk.index >= self._count:
            raise InvalidArgument(f"chunk {chunk.index} is past the stream's {self._count} chunks")
        if self._received_bytes + len(chunk.data) > self._total_bytes:
            raise InvalidArgument(f"chunks overrun the block's {self._total_bytes} bytes")
        self._parts.append(chunk.data)
        self._received_bytes += len(chunk.data)
        if self._hasher is not None:
            self._hasher.update(chunk.data)

    def finish(self) -> bytes:
        """The block's bytes, once every chunk arrived and (when verifying) the checksum matches."""
        if self._count is None:
            raise InvalidArgument("the stream carried no chunks")
        if len(self._parts) != self._count or self._received_bytes != self._total_bytes:
            raise InvalidArgument(
                f"stream ended after {len(self._parts)} of {self._count} chunks, "
                f"{self._received_bytes} of {self._total_bytes} bytes"
            )
        if self._hasher is not None and self._hasher.digest() != self._checksum:
            raise InvalidArgument("block checksum mismatch: the data was corrupted on the way")
        return b"".join(self._parts)

    def _start(self, chunk: Chunk) -> None:
        if chunk.count < 1 or chunk.total_bytes < 0:
            raise InvalidArgument(f"bad chunk header: count {chunk.count}, total_bytes {chunk.total_bytes}")
        if self._max_bytes is not None and chunk.total_bytes > self._max_bytes:
            raise ResourceExhausted(
                f"block of {chunk.total_bytes} bytes exceeds the store's {self._max_bytes}-byte limit"
            )
        self._count = chunk.count
        self._total_bytes = chunk.total_bytes
