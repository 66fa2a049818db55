"""bench/tensor_parallel.py's mesh part: TTFT of a long prompt for each (prefill TP, decode TP) pair.

Each pair gets a real mesh (gateway -> router -> prefill -> decode, Redis and the kvstore; bench/ttft_mesh.py's
``start``: the router never lets decode prefill), with the prefill and decode workers over their degrees. Every
pair moves KV over the one transport asked for: NIXL (each decode rank READs its KV heads from the prefill
ranks holding them) or gRPC (blocks gathered whole on rank 0). Prompts are fresh, so each is computed on the
prefill worker and handed to decode.
Meshes are started round by round, the pairs' order reversed every other round.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import torch
from _table import print_table
from kv_transfer import VOCAB
from ttft_mesh import measure, start, write_model_with_tokenizer

from kvmesh.launcher.supervisor import MeshError

PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (prefill ranks, decode ranks); the first is the anchor


def run_pairs(tmp: Path, tokens: int, prompts: int, rounds: int, transport: str) -> dict[str, dict]:
    """Medians per pair (TTFT, prefill and transfer ms) and every sample."""
    g = torch.Generator().manual_seed(11)
    batch = [torch.randint(1, VOCAB, (tokens,), generator=g).tolist() for _ in range(prompts + 1)]
    blocks = 2 * (tokens // 16 + 8) * (prompts + 1)
    model = tmp / "llama"
    write_model_with_tokenizer(model, tokens + 64)
    samples: dict[str, list[dict]] = {_name(p): [] for p in PAIRS}
    failures: list[str] = []
    for rnd in range(rounds):
        for prefill_tp, decode_tp in PAIRS[:: -1 if rnd % 2 else 1]:
            name = _name((prefill_tp, decode_tp))
            env = {"KVMESH_KV_TRANSPORT": transport}
            role_tp = {"prefill": {"KVMESH_TENSOR_PARALLEL_SIZE": str(prefill_tp)}}
            role_tp["decode"] = {"KVMESH_TENSOR_PARALLEL_SIZE": str(decode_tp)}
            try:
                with start(model, tmp / f"{name}-{rnd}", env, blocks, role_tp) as mesh:
                    samples[name] += asyncio.run(measure(mesh, batch))
            except MeshError as e:  # reported, and the run goes on: one failed start is not a measurement
                failures.append(f"round {rnd + 1} {name}: {e}\n{e.log_tail}")
                print(f"  round {rnd + 1} {name}: FAILED TO START: {e}\n{e.log_tail}", flush=True)
                continue
            print(f"  round {rnd + 1} {name}: TTFT {samples[name][-1]['ttft_ms']:.0f} ms", flush=True)
    anchor = statistics.median(r["ttft_ms"] for r in samples[_name(PAIRS[0])])
    out: dict[str, dict] = {"failed_starts": failures, "transport": transport}
    for name, runs in samples.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        out[name] = med | {"ttft_ratio": med["ttft_ms"] / anchor, "samples": runs}
    return out


def print_pairs(results: dict[str, dict], tokens: int) -> None:
    pairs = {name: r for name, r in results.items() if name.startswith("TP")}
    print(f"\nTTFT of a fresh {tokens}-token prompt through the mesh (KV over {results['transport']}), medians")
    rows = [
        [name, str(len(r["samples"])), f"{r['prefill_ms']:.0f}", f"{r['transfer_ms']:.1f}", f"{r['ttft_ms']:.0f}",
         f"{r['ttft_ratio']:.2f}x"]
        for name, r in pairs.items()
    ]  # fmt: skip
    print_table(["prefill/decode ranks", "prompts", "prefill ms", "transfer ms", "TTFT ms", f"vs {next(iter(pairs))}"],
                rows)  # fmt: skip
    for failure in results["failed_starts"]:
        print(f"  failed start: {failure.splitlines()[0]}")


def _name(pair: tuple[int, int]) -> str:
    return f"TP{pair[0]}/TP{pair[1]}"
