"""The one checksum a kvstore block carries: in RAM, on disk and on the wire.

blake2b catches any corruption (bit flips, truncation, a torn write) and runs
at memory speed; 16 bytes is plenty for integrity, which is all it is for here
(a block's *name* is its chained hash from ``kvmesh.blocks``).
"""

from __future__ import annotations

import hashlib

CHECKSUM_BYTES = 16


def new_hasher() -> "hashlib._Hash":
    """An incremental hasher, for data that arrives in pieces (streamed chunks)."""
    return hashlib.blake2b(digest_size=CHECKSUM_BYTES)


def checksum(data: bytes | memoryview) -> bytes:
    hasher = new_hasher()
    hasher.update(data)
    return hasher.digest()
