from __future__ import annotations

import random

import pytest

from kvmesh.checksum import checksum
from kvmesh.chunking import DEFAULT_CHUNK_BYTES, Chunk, Reassembler, split
from kvmesh.errors import InvalidArgument, ResourceExhausted

MIB = 1 << 20


def reassemble(chunks, expected_checksum: bytes, max_bytes: int | None = None) -> bytes:
    reassembler = Reassembler(expected_checksum, max_bytes)
    for chunk in chunks:
        reassembler.add(chunk)
    return reassembler.finish()


def test_block_larger_than_a_chunk_round_trips():
    data = random.Random(1).randbytes(3 * MIB + MIB // 2)
    chunks = list(split(data, chunk_bytes=MIB))
    assert [(c.index, c.count, c.total_bytes, len(c.data)) for c in chunks] == [
        (0, 4, len(data), MIB),
        (1, 4, len(data), MIB),
        (2, 4, len(data), MIB),
        (3, 4, len(data), MIB // 2),
    ]
    assert reassemble(chunks, checksum(data)) == data


def test_default_chunk_is_well_under_grpc_message_limit():
    assert DEFAULT_CHUNK_BYTES <= 1 * MIB
    chunks = list(split(bytes(2 * DEFAULT_CHUNK_BYTES)))
    assert len(chunks) == 2 and all(len(c.data) == DEFAULT_CHUNK_BYTES for c in chunks)


def test_empty_block_is_one_empty_chunk():
    chunks = list(split(b""))
    assert chunks == [Chunk(0, 1, 0, b"")]
    assert reassemble(chunks, checksum(b"")) == b""


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError):
        list(split(b"abc", chunk_bytes=0))


DATA = bytes(range(256)) * 4  # 1 KiB, cut into 4 chunks of 256 below
GOOD = list(split(DATA, chunk_bytes=256))


@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param([], id="no chunks"),
        pytest.param(GOOD[:3], id="last chunk missing"),
        pytest.param([GOOD[0], GOOD[2], GOOD[1], GOOD[3]], id="out of order"),
        pytest.param([GOOD[0], GOOD[0]], id="duplicate"),
        pytest.param(GOOD[1:], id="first chunk missing"),
        pytest.param([GOOD[0], Chunk(1, 5, 1024, GOOD[1].data)], id="count changes"),
        pytest.param([GOOD[0], Chunk(1, 4, 2048, GOOD[1].data)], id="total changes"),
        pytest.param([*GOOD, Chunk(4, 4, 1024, b"")], id="past the count"),
        pytest.param([Chunk(0, 2, 300, DATA[:256]), Chunk(1, 2, 300, DATA[256:512])], id="overrun"),
        pytest.param([Chunk(0, 0, 0, b"")], id="zero count"),
        pytest.param([Chunk(0, 1, -1, b"")], id="negative total"),
        pytest.param([*GOOD[:3], Chunk(3, 4, 1024, b"\xff" + GOOD[3].data[1:])], id="corrupted byte"),
    ],
)
def test_malformed_streams_are_invalid_argument(chunks):
    with pytest.raises(InvalidArgument):
        reassemble(chunks, checksum(DATA))


def test_oversized_block_is_refused_before_buffering():
    reassembler = Reassembler(checksum(DATA), max_bytes=1000)
    with pytest.raises(ResourceExhausted):
        reassembler.add(GOOD[0])  # the header says 1024 bytes: refused on the first chunk
