"""A fake Hugging Face hub cache, laid out as ``huggingface_hub`` writes one (``snapshot_download``).

``models--org--name/blobs/<etag>``: each file's content once, named by its etag (a git blob's sha1 for a
regular file, the sha256 for an LFS file: weights); ``snapshots/<commit>/<file>``: relative symlinks
``../../blobs/<etag>`` (one more ``../`` per subfolder); ``refs/<branch>``: the commit hash, no newline.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def etag(name: str, data: bytes) -> str:
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, hub_id: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """``source``'s files as the snapshot ``commit`` of ``hub_id`` in ``cache``, named by ``refs``; its folder."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = file.relative_to(source)
        data = file.read_bytes()
        blob = repo / "blobs" / etag(file.name, data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
