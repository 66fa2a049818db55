"""Reading a Hugging Face folder's safetensors weights (single file or sharded)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvmesh.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model folder, via the shard index when there is one."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{index}: not a valid shard index ({e})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing (named by {index})")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    return files


def iter_tensors(files: list[Path], names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The files' tensors by name; with ``names``, only those (the others are never read)."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if names is None or name in names:
                        yield name, st.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{f}: corrupt or unreadable safetensors file ({e})") from None


def weights_id(files: list[Path]) -> str:
    """A cheap identity of the weights: names, sizes and safetensors headers (not the payload)."""
    d = hashlib.blake2b(digest_size=16)
    for f in files:
        with open(f, "rb") as fh:
            header_len_bytes = fh.read(8)
            header_len = int.from_bytes(header_len_bytes, "little") if len(header_len_bytes) == 8 else 0
            d.update(f.name.encode())
            d.update(str(f.stat().st_size).encode())
            d.update(fh.read(min(header_len, 1 << 24)))
    return d.hexdigest()
