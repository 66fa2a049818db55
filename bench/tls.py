"""What mutual TLS inside the mesh costs: HTTP tokens/s and TTFT with it on (the default) and off.

Two meshes of the compose file's topology (gateway, router, kvstore, prefill, decode; no speculator)
on the same model run side by side, one with mutual TLS (`kvmesh up`) and one plaintext
(`kvmesh up --insecure`), and the rounds alternate between them (off, on, on, off, ...), so the
machine's noise falls on both; each round streams ``--streams`` greedy completions of ``--max-tokens``
through the gateway's OpenAI HTTP API, every prompt made unique to its round (no prefix-cache hits
from an earlier round). Reports medians; the cost is on/off - 1.

    python bench/tls.py --rounds 6 --json bench/results/tls.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from _common import write_json  # noqa: E402
from _side_by_side import round_flags, running_mesh, unique  # noqa: E402
from _table import print_table  # noqa: E402
from engine import chat_prompts  # noqa: E402
from peers import http_round, model_id  # noqa: E402

from kvmesh.engine.default_model import default_model_path  # noqa: E402
from kvmesh.launcher.spec import MeshOptions  # noqa: E402

MODES = ("off", "on")


@contextlib.contextmanager
def mesh(model: Path, tls: bool, workdir: Path) -> Iterator[str]:
    opts = MeshOptions(model=model, speculator=False, publish=False, gateway_port=0, log_level="warning", tls=tls)
    with running_mesh(opts, workdir, f"tls-{'on' if tls else 'off'}-") as (url, _, topology):
        assert (topology.certs is not None) == tls
        yield url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    round_flags(parser)
    args = parser.parse_args()
    model = args.model or default_model_path()
    prompts = chat_prompts(model, args.streams)
    samples: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp, contextlib.ExitStack() as stack:
        urls = {m: stack.enter_context(mesh(model, m == "on", Path(tmp))) for m in MODES}
        served = model_id(urls["on"])
        # Warm both (first-request costs: tokenizer, allocator, connections) before anything is measured.
        for m in MODES:
            asyncio.run(http_round(urls[m], served, unique(prompts, 0), 8))
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for m in order:
                result = asyncio.run(
                    http_round(urls[m], served, unique(prompts, 1 + 2 * r + MODES.index(m)), args.max_tokens)
                )
                samples[m].append(result)
                print(f"round {r + 1} tls {m}: {result['tokens_per_s']:.1f} tok/s, TTFT {result['ttft_s']:.3f} s")
    med = {
        m: {
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in samples[m]),
            "ttft_s": statistics.median(s["ttft_s"] for s in samples[m]),
        }
        for m in MODES
    }
    cost = {
        "tokens_per_s": 1 - med["on"]["tokens_per_s"] / med["off"]["tokens_per_s"],
        "ttft_s": med["on"]["ttft_s"] / med["off"]["ttft_s"] - 1,
    }
    # Each round's on - off (the order inside a round alternates, so what running second costs cancels out).
    paired_ttft_ms = statistics.mean(
        1e3 * (on["ttft_s"] - off["ttft_s"]) for on, off in zip(samples["on"], samples["off"], strict=True)
    )
    rows = [[f"mutual TLS {m}", f"{med[m]['tokens_per_s']:.1f}", f"{med[m]['ttft_s']:.3f}"] for m in MODES]
    rows.append(["cost of TLS", f"{100 * cost['tokens_per_s']:+.1f}%", f"{100 * cost['ttft_s']:+.1f}%"])
    rows.append(["TTFT on - off, mean of rounds", "", f"{paired_ttft_ms:+.1f} ms"])
    print_table([f"{args.streams} streams x {args.max_tokens} tokens", "tok/s (median)", "TTFT s (median)"], rows)
    write_json(
        args.json,
        {
            "model": str(model),
            "streams": args.streams,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "samples": {m: [{k: s[k] for k in ("tokens_per_s", "ttft_s")} for s in samples[m]] for m in MODES},
            "medians": med,
            "cost": cost,
            "paired_ttft_ms": paired_ttft_ms,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
