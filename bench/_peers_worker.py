"""The loop every in-process peer runs in its own interpreter (standard library only: it runs in the peers' venvs).

The parent (bench/peers.py) writes one JSON request per line to stdin, ``{"prompts": [[ids]], "max_tokens": n}``,
and reads one JSON line per request from the file descriptor ``PEERS_RESULT_FD``: ``{"seconds": s, "tokens": [[ids]]}``
(wall time of the whole call, prefill included; the new tokens per prompt). The first line there is ``{"ready": true}``
once the model is loaded and warm. A separate descriptor, because the peers log to stdout and stderr.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

Generate = Callable[[list[list[int]], int], tuple[float, list[list[int]]]]


def serve(generate: Generate) -> None:
    with os.fdopen(int(os.environ["PEERS_RESULT_FD"]), "w") as out:
        out.write(json.dumps({"ready": True}) + "\n")
        out.flush()
        for line in sys.stdin:
            req = json.loads(line)
            seconds, tokens = generate(req["prompts"], req["max_tokens"])
            out.write(json.dumps({"seconds": seconds, "tokens": tokens}) + "\n")
            out.flush()
