"""The training corpus: the CPython standard library's own ``.py`` files.

Every machine with this Python has them, so training needs no download. The
file order is sorted by relative path and the held-out split is chosen by a
hash of that path, so both are the same on every run (and a file keeps its
side of the split even when another Python version adds or drops files).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

# Prose dumped into Python strings (pydoc's topic help), not code.
SKIPPED_DIRS = {"site-packages", "pydoc_data"}


@dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str


@dataclass(frozen=True)
class Split:
    train: list[SourceFile]
    valid: list[SourceFile]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """All UTF-8 ``.py`` files under the stdlib, sorted by relative path.

    A few test files are deliberately in other encodings; they are skipped so
    the corpus is exactly what the tokenizer will see.
    """
    root = root or stdlib_root()
    out = []
    for f in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = f.relative_to(root)
        if SKIPPED_DIRS & set(rel.parts):
            continue
        try:
            text = f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            out.append(SourceFile(rel.as_posix(), text))
    return out


def is_held_out(relpath: str, percent: int) -> bool:
    digest = hashlib.blake2b(relpath.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 100 < percent


def split_files(files: list[SourceFile], valid_percent: int = 3) -> Split:
    train = [f for f in files if not is_held_out(f.relpath, valid_percent)]
    valid = [f for f in files if is_held_out(f.relpath, valid_percent)]
    return Split(train, valid)


def token_stream(tok: Tokenizer, files: list[SourceFile], eos_id: int) -> torch.Tensor:
    """The files' tokens back to back, each file preceded by end-of-text (a document break)."""
    ids: list[int] = []
    for enc in tok.encode_batch([f.text for f in files], add_special_tokens=False):
        ids.append(eos_id)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` windows of ``length`` tokens at random offsets (seeded by ``gen``)."""
    starts = torch.randint(0, len(stream) - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()


def tiled_windows(stream: torch.Tensor, length: int) -> torch.Tensor:
    """The stream cut into consecutive windows of ``length`` (the ragged tail is dropped)."""
    n = len(stream) // length
    return stream[: n * length].view(n, length).long()
