"""kvmesh in-process for bench/peers.py: bench/engine.py's engine and run, behind the peers' worker loop.

Run: ``python bench/_peers_inproc_kvmesh.py MODEL_DIR DTYPE COMPILE(0|1) QUANTIZATION(none|int8)`` (the project
environment, PYTHONPATH at the repo). A quantization covers the LM head too (bench/peers.py says why).
Warms up, no prefix cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_worker import serve  # noqa: E402
from engine import make_engine, run_kvmesh  # noqa: E402


def main() -> None:
    quantization = None if sys.argv[4] == "none" else sys.argv[4]  # with it, the LM head's too
    engine = make_engine(Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", quantization, quantization is not None)
    serve(lambda prompts, n: run_kvmesh(engine, prompts, n))


if __name__ == "__main__":
    main()
