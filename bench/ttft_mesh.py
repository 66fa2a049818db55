"""TTFT of a long prompt through the whole disaggregated mesh, per KV transport, same run.

A real mesh per transport (gateway -> router -> prefill -> decode, with Redis,
the kvstore and no speculator, as ``kvmesh up`` starts it; the router never lets
decode prefill, so every prompt takes the prefill -> decode hand-off). Each
prompt is fresh (computed on prefill). TTFT is the time from the gateway's
``Generate`` call to its first token; the final message says what prefill
(``prefill_timings``) and the hand-off (``decode_timings.transfer_ns``) took of it.
Transports: ``grpc`` (the anchor: the PullKV chunk stream), ``nixl`` (UCX's
default transports) and ``nixl_tcp`` (``UCX_TLS=tcp,self`` on prefill, decode and
kvstore: the cross-host mode).

Run: ``flock /tmp/kvmesh-bench.lock python bench/ttft_mesh.py [--tokens 8000] [--prompts 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402
from kv_transfer import VOCAB, write_model  # noqa: E402

from kvmesh.api.common.v1 import sampling_pb2  # noqa: E402
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from kvmesh.launcher.spec import MeshOptions  # noqa: E402
from kvmesh.launcher.supervisor import Mesh  # noqa: E402
from kvmesh.launcher.topology import build_topology  # noqa: E402
from kvmesh.models.bpe import train_tokenizer, write_tokenizer  # noqa: E402

TRANSPORTS = {
    "grpc": {"KVMESH_KV_TRANSPORT": "grpc"},
    "nixl": {"KVMESH_KV_TRANSPORT": "nixl"},
    "nixl_tcp": {"KVMESH_KV_TRANSPORT": "nixl", "UCX_TLS": "tcp,self"},
}
NEW_TOKENS = 4


def start(
    model: Path,
    run_dir: Path,
    transport_env: dict[str, str],
    num_blocks: int,
    role_env: dict[str, dict[str, str]] | None = None,
) -> Mesh:
    """The mesh for one measurement; ``role_env`` adds settings per role (bench/tensor_parallel.py: ranks)."""
    worker = {"KVMESH_NUM_BLOCKS": str(num_blocks), "KVMESH_MAX_NUM_BATCHED_TOKENS": "2048", **transport_env}
    env = {
        "router": {"KVMESH_LOCAL_PREFILL_MAX_UNCACHED_TOKENS": "0", "KVMESH_LOCAL_PREFILL_MIN_HIT_FRACTION": "2"},
        "prefill": worker,
        "decode": worker,
        "kvstore": transport_env,
    }
    for role, extra in (role_env or {}).items():
        env[role] = {**env.get(role, {}), **extra}
    opts = MeshOptions(model=model, gateway_port=0, publish=False, role_env=env, log_level="warning", speculator=False)
    return Mesh(build_topology(opts, run_dir), run_dir)


def write_model_with_tokenizer(path: Path, max_tokens: int) -> None:
    """bench/kv_transfer.py's model, with a trained tokenizer beside it (the gateway loads one)."""
    write_model(path, max_tokens)
    tok = path.parent / "tok"
    tok.mkdir()
    write_tokenizer(train_tokenizer(VOCAB, corpus_bytes=300_000), tok)
    for f in tok.iterdir():
        shutil.copy(f, path / f.name)


async def one(gateway: gateway_pb2_grpc.GatewayServiceStub, prompt: list[int]) -> dict:
    req = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    t0 = time.perf_counter()
    ttft = final = None
    async for msg in gateway.Generate(req, timeout=600):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - t0
        if msg.HasField("final"):
            final = msg.final
    return {
        "ttft_ms": ttft * 1e3,
        "prefill_ms": final.prefill_timings.total_ns / 1e6,
        "transfer_ms": final.decode_timings.transfer_ns / 1e6,
    }


async def measure(mesh: Mesh, prompts: list[list[int]]) -> list[dict]:
    async with grpc.aio.insecure_channel(mesh.address("gateway")) as ch:
        gateway = gateway_pb2_grpc.GatewayServiceStub(ch)
        await one(gateway, prompts[0][:64])  # warm-up: connections, the NIXL handshakes
        return [await one(gateway, p) for p in prompts[1:]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--prompts", type=int, default=2, help="fresh prompts per transport and round")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="a mesh per transport per round, the order reversed "
        "every other round (so none always runs first); the median is over all prompts",
    )
    ap.add_argument("--json", default="bench/results/ttft_mesh.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, VOCAB, (args.tokens,), generator=g).tolist() for _ in range(args.prompts + 1)]
    num_blocks = 2 * (args.tokens // 16 + 8) * (args.prompts + 1)
    samples: dict[str, list[dict]] = {name: [] for name in TRANSPORTS}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama"
        write_model_with_tokenizer(model, args.tokens + 64)
        for rnd in range(args.rounds):
            for name in list(TRANSPORTS)[:: -1 if rnd % 2 else 1]:
                with start(model, Path(tmp) / f"{name}-{rnd}", TRANSPORTS[name], num_blocks) as mesh:
                    samples[name] += asyncio.run(measure(mesh, prompts))
    results = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"samples": runs}
        for name, runs in samples.items()
    }
    anchor = results["grpc"]["ttft_ms"]
    for r in results.values():
        r["ttft_ratio_to_grpc"] = r["ttft_ms"] / anchor
    print(
        f"TTFT of a fresh {args.tokens}-token prompt through the gateway (real mesh), "
        f"median of {args.rounds * args.prompts}"
    )
    print_table(
        ["transport", "prefill ms", "transfer ms", "TTFT ms", "TTFT / grpc"],
        [
            [
                t,
                f"{r['prefill_ms']:.0f}",
                f"{r['transfer_ms']:.1f}",
                f"{r['ttft_ms']:.0f}",
                f"{r['ttft_ratio_to_grpc']:.3f}",
            ]
            for t, r in results.items()
        ],
    )
    write_json(
        args.json, {"tokens": args.tokens, "prompts": args.prompts, "rounds": args.rounds, "transports": results}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
