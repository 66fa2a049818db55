"""The one definition of a KV block's name.

KV is cut into blocks of ``block_size`` tokens. A *full* block is named by a
chained hash::

    h_i = blake2b(h_{i-1} || fingerprint || salt || tokens of block i)

so equal names mean equal KV: the same model (fingerprint), the same tenant
(cache salt) and the same token prefix up to and including block i. The GPU
cache, the kvstore and the router's Redis index all use these names; every
service imports this module rather than re-deriving it.

A partial trailing block has no name: its KV is still changing.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

import numpy

BlockHash = bytes
"""A block's name: ``HASH_BYTES`` raw bytes (hex only for logs and Redis keys)."""

HASH_BYTES = 16  # 128-bit blake2b: collision-resistant, compact in Redis.
DEFAULT_BLOCK_SIZE = 16

# The chain's root: what block 0 is chained onto.
_ROOT = b"\x00" * HASH_BYTES


def _h(*parts: bytes) -> bytes:
    d = hashlib.blake2b(digest_size=HASH_BYTES)
    for p in parts:
        # Length-prefix each part so (a, bc) and (ab, c) never collide.
        d.update(struct.pack("<Q", len(p)))
        d.update(p)
    return d.digest()


def model_fingerprint(config: dict, dtype: str, block_size: int) -> bytes:
    """Fingerprint of everything that changes a block's KV bytes for a given prefix.

    ``config`` is the model's config.json content; weights identity is represented
    by the architecture fields plus ``weights_id`` when the caller supplies one
    (e.g. a checksum of the safetensors index) in ``config``.
    """
    canonical = json.dumps(
        {"config": config, "dtype": dtype, "block_size": block_size},
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return _h(b"kvmesh-fingerprint-v1", canonical.encode())


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: bytes,
    cache_salt: bytes = b"",
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Names of every full block of ``token_ids`` (a trailing partial block is skipped).

    ``parent`` continues an existing chain: ``token_ids`` must then start at a
    block boundary right after the block named ``parent``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    # Byte-for-byte what _h(prev, fingerprint, cache_salt, tokens) hashes, with the parts that
    # are the same for every block prepared once: a 200k-token prompt is 12,500 blocks.
    prev_len = struct.pack("<Q", HASH_BYTES)
    middle = struct.pack("<Q", len(fingerprint)) + fingerprint + struct.pack("<Q", len(cache_salt)) + cache_salt
    middle += struct.pack("<Q", 4 * block_size)
    tokens = numpy.asarray(token_ids[: n_full * block_size], dtype="<u4").tobytes()
    step = 4 * block_size
    prev = parent if parent is not None else _ROOT
    out: list[BlockHash] = []
    blake2b = hashlib.blake2b
    for i in range(n_full):
        d = blake2b(prev_len, digest_size=HASH_BYTES)
        d.update(prev)
        d.update(middle)
        d.update(tokens[i * step : (i + 1) * step])
        prev = d.digest()
        out.append(prev)
    return out


def adapter_fingerprint(model_fingerprint: bytes, adapter_id: bytes) -> bytes:
    """The fingerprint of blocks computed under a LoRA adapter (``adapter_id``: the adapter's
    content hash, kvmesh.checkpoint.peft_adapter): chained in place of the model's, so a prefix
    cached under one adapter never names the same blocks as under another or the base model."""
    return _h(b"kvmesh-adapter-v1", model_fingerprint, adapter_id)
