"""Files made from the code and committed (docs/services.md, the CPU compose file, the chart's authorization
edges): each generator writes its file, or with ``--check`` fails when the committed one differs."""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(path: Path, text: str, *, check: bool, regenerate: str) -> int:
    """Write ``text`` to ``path`` (0), or with ``check`` compare: 1 and how to mend (``regenerate``) when stale."""
    if check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is stale: run {regenerate}", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0
