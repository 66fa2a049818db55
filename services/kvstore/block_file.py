"""One block's file on disk: a self-checking header, then the payload.

Layout, little-endian::

    signed   magic b"KVMB", version u16, meta length u32, payload length u64,
             block hash (16 B), payload checksum (16 B)
    sealed   header checksum (16 B) over ``signed`` + ``meta``
    meta     JSON {"shape": [...], "dtype": "..."}
    payload  the block's bytes

The header checksum lets a startup scan trust a file's header (and, with the
file size, detect truncation) without reading the payload; the payload
checksum is verified on every read.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvmesh.blocks import HASH_BYTES, BlockHash
from kvmesh.checksum import CHECKSUM_BYTES, checksum
from kvmesh.errors import InvalidArgument
from services.kvstore.block import Block

MAGIC = b"KVMB"
VERSION = 2  # 2: CRC-32 checksums (1 had blake2b)
# Shape and dtype fit in a few dozen bytes; a bigger length means a corrupt header.
MAX_META_BYTES = 4096

_SIGNED = struct.Struct(f"<4sHIQ{HASH_BYTES}s{CHECKSUM_BYTES}s")
_FIXED_BYTES = _SIGNED.size + CHECKSUM_BYTES


class CorruptBlockFile(Exception):
    """A block file that must not be served: bad header, wrong length or checksum.

    Internal to the kvstore core: a corrupt block is reported missing, never raised.
    """


@dataclass(frozen=True, slots=True)
class BlockFileHeader:
    block_hash: BlockHash
    payload_bytes: int
    checksum: bytes
    shape: tuple[int, ...]
    dtype: str
    header_bytes: int

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes


def encode_header(block_hash: BlockHash, block: Block) -> bytes:
    meta = json.dumps({"shape": list(block.shape), "dtype": block.dtype}, separators=(",", ":")).encode()
    signed = _SIGNED.pack(MAGIC, VERSION, len(meta), block.nbytes, block_hash, block.checksum)
    return signed + checksum(signed + meta) + meta


def read_header(f: BinaryIO) -> BlockFileHeader:
    fixed = f.read(_FIXED_BYTES)
    if len(fixed) != _FIXED_BYTES:
        raise CorruptBlockFile("header truncated")
    signed, sealed = fixed[: _SIGNED.size], fixed[_SIGNED.size :]
    magic, version, meta_len, payload_len, block_hash, payload_checksum = _SIGNED.unpack(signed)
    if magic != MAGIC:
        raise CorruptBlockFile(f"bad magic {magic!r}")
    if version != VERSION:
        raise CorruptBlockFile(f"unsupported version {version}")
    if meta_len > MAX_META_BYTES:
        raise CorruptBlockFile(f"meta length {meta_len} over {MAX_META_BYTES}")
    meta = f.read(meta_len)
    if len(meta) != meta_len:
        raise CorruptBlockFile("meta truncated")
    if checksum(signed + meta) != sealed:
        raise CorruptBlockFile("header checksum mismatch")
    try:
        fields = json.loads(meta)
        shape, dtype = tuple(fields["shape"]), fields["dtype"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptBlockFile(f"unreadable meta: {e}") from e
    return BlockFileHeader(block_hash, payload_len, payload_checksum, shape, dtype, _FIXED_BYTES + meta_len)


def write_block_file(path: Path, block_hash: BlockHash, block: Block) -> None:
    """Write atomically: a temp file in the same directory, fsync, then rename.

    A crash leaves either the old state or the whole file under ``path``, never
    a torn one (a leftover ``*.tmp`` is swept at the next startup). The
    directory is not fsynced: losing a rename in a crash only loses a cached
    block, and integrity never depends on it.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode_header(block_hash, block))
            f.write(block.data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_block_file(path: Path, block_hash: BlockHash) -> Block:
    """The block stored in ``path``, fully verified; raises ``CorruptBlockFile``
    (or ``OSError`` from the file system, ``FileNotFoundError`` when it is gone)."""
    with path.open("rb") as f:
        header = read_header(f)
        if header.block_hash != block_hash:
            raise CorruptBlockFile(f"file holds block {header.block_hash.hex()}")
        payload = f.read()
    if len(payload) != header.payload_bytes:
        raise CorruptBlockFile(f"payload is {len(payload)} bytes, header says {header.payload_bytes}")
    if checksum(payload) != header.checksum:
        raise CorruptBlockFile("payload checksum mismatch")
    try:
        return Block(payload, header.shape, header.dtype, header.checksum)
    except InvalidArgument as e:  # a sealed header with meta no valid block has
        raise CorruptBlockFile(str(e)) from e
