"""KV blocks on the wire: one block's bytes <-> a run of ``KVBlockChunk`` messages.

The block's bytes are the engine's export format (``kvmesh.engine.kv_cache``);
chunking and the checksum are the kvstore's (one definition each). Every hop
that moves KV — prefill -> decode, worker <-> kvstore — goes through here.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvmesh.blocks import BlockHash
from kvmesh.common.v1 import kv_pb2
from kvmesh.engine.kv_cache import BlockPayload
from kvmesh.errors import InvalidArgument
from kvmesh.checksum import checksum
from kvmesh.chunking import DEFAULT_CHUNK_BYTES, Chunk, Reassembler, split


def block_to_chunks(
    h: BlockHash, payload: BlockPayload, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[kv_pb2.KVBlockChunk]:
    digest = checksum(payload.data)
    for c in split(payload.data, chunk_bytes or DEFAULT_CHUNK_BYTES):
        yield kv_pb2.KVBlockChunk(
            block_hash=h,
            chunk_index=c.index,
            num_chunks=c.count,
            total_bytes=c.total_bytes,
            shape=list(payload.shape),
            dtype=payload.dtype,
            checksum=digest,
            data=c.data,
        )


class BlockAssembler:
    """Feeds chunks of consecutive blocks; yields each block once its last chunk is in
    and its checksum verified (a bad block raises InvalidArgument)."""

    def __init__(self, max_block_bytes: int | None = None) -> None:
        self._max = max_block_bytes
        self._hash: bytes | None = None
        self._parts: Reassembler | None = None
        self._first: kv_pb2.KVBlockChunk | None = None

    def add(self, chunk: kv_pb2.KVBlockChunk) -> tuple[BlockHash, BlockPayload] | None:
        if self._parts is None or chunk.chunk_index == 0:
            if self._parts is not None:
                raise InvalidArgument(f"block {self._hash.hex() if self._hash else '?'} ended before its last chunk")
            self._hash, self._first = chunk.block_hash, chunk
            self._parts = Reassembler(chunk.checksum, self._max)
        elif chunk.block_hash != self._hash:
            raise InvalidArgument("chunks of different blocks interleaved")
        self._parts.add(Chunk(chunk.chunk_index, chunk.num_chunks, chunk.total_bytes, chunk.data))
        if chunk.chunk_index + 1 < chunk.num_chunks:
            return None
        data = self._parts.finish()
        first, h = self._first, self._hash
        self._parts = self._first = self._hash = None
        return h, BlockPayload(tuple(first.shape), first.dtype, data)

    def close(self) -> None:
        """The stream ended: a block still half-received is an error."""
        if self._parts is not None:
            raise InvalidArgument("stream ended in the middle of a block")
