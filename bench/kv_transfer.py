"""KV transfer prefill -> decode per transport vs a raw loopback TCP copy of the same bytes, same run.

Transports: ``grpc`` (the chunked PullKV stream), ``nixl`` (one NIXL READ into
decode's pool, UCX's default transports: shared memory on one host) and
``nixl_tcp`` (the same with ``UCX_TLS=tcp,self`` on both ends: the cross-host
mode). Cells: 64 and 512 blocks, for two block sizes (``--block-sizes``).

Real processes, no router: this script plays the gateway. Per block size it
starts a kvstore, a prefill worker on NIXL (which also serves PullKV), one with
``UCX_TLS=tcp,self``, and a decode worker per transport. Prefill's KV is not
computed for the cells (512 blocks of 64 tokens would be a 32k-token prefill
per prompt, minutes on a CPU): the script puts random KV blocks under each
prompt's block hashes into the kvstore, and the prefill workers import them
from there on their first Prefill of the prompt (a kvstore hit, over gRPC).
Each trial then re-prefills a cached prompt (one token computed, a fresh lease
on the same blocks), and decode's pool holds only one cell's blocks, so the
prompts a decode worker cycles through are always evicted before they come
round again and every trial moves every block. The time is
decode's own ``DecodeFinal.timings.transfer_ns`` (missing-block lookup, handshake
cached from the warm-up, transfer, checksum verification, import or adoption,
lease release): every transport verifies every block's CRC-32 inside that time.
The anchor is a raw TCP copy of the same byte count (one socket, no framing, no
checksum: the bare copy), run after each round, so each ratio compares medians
taken under the same load.

Also: the TTFT of one ``--ttft-tokens`` prompt per transport (fresh, computed on
prefill, which also writes its new blocks to the kvstore behind, as a mesh with
a kvstore does), as a gateway sees it: the Prefill call plus decode's first
token (the transfer comes before it); and what the block checksum costs (CRC-32
over the pool's blocks, as both ends compute it).

Run: ``flock /tmp/kvmesh-bench.lock python bench/kv_transfer.py [--trials 5] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402

from kvmesh.api.common.v1 import sampling_pb2  # noqa: E402
from kvmesh.api.decode.v1 import decode_pb2, decode_pb2_grpc  # noqa: E402
from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc  # noqa: E402
from kvmesh.api.prefill.v1 import prefill_pb2, prefill_pb2_grpc  # noqa: E402
from kvmesh.engine.config import (
    EngineConfig,  # noqa: E402
    dtype_name,  # noqa: E402
)
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.engine.kv_cache import BlockPayload  # noqa: E402
from kvmesh.kv_wire import block_to_chunks  # noqa: E402
from kvmesh.launcher.compose import REPO_ROOT  # noqa: E402
from kvmesh.launcher.spec import ProcessSpec, Topology  # noqa: E402
from kvmesh.launcher.supervisor import Mesh  # noqa: E402
from kvmesh.runtime import create_channel
from kvmesh.runtime.ports import free_port  # noqa: E402

VOCAB = 2048
TRANSPORTS = ("grpc", "nixl", "nixl_tcp")
TCP_ONLY = {"UCX_TLS": "tcp,self"}
MARGIN_BLOCKS = 8


def write_model(path: Path, max_tokens: int) -> None:
    """bench/mesh.py's model shape: 6 layers, 4 KV heads of 64, fp32 -> 192 KiB per 16-token block."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_tokens,
        initializer_range=0.1,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def kvstore(name: str, budget_bytes: int) -> ProcessSpec:
    port, metrics_port = free_port(), free_port()
    env = {
        "KVMESH_HOST": "127.0.0.1",
        "KVMESH_PORT": str(port),
        "KVMESH_METRICS_PORT": str(metrics_port),
        "KVMESH_RAM_BUDGET_BYTES": str(budget_bytes),
        "KVMESH_LOG_LEVEL": "warning",
        "PYTHONUNBUFFERED": "1",
    }
    argv = (sys.executable, "-m", "services.kvstore.main")
    return ProcessSpec(name, "kvstore", argv, env, "127.0.0.1", port, metrics_port, "cpu", workdir=REPO_ROOT)


def worker(name: str, role: str, model: Path, num_blocks: int, block_size: int, env: dict[str, str]) -> ProcessSpec:
    port, metrics_port = free_port(), free_port()
    env = {
        "KVMESH_HOST": "127.0.0.1",
        "KVMESH_PORT": str(port),
        "KVMESH_METRICS_PORT": str(metrics_port),
        "KVMESH_MODEL": str(model),
        "KVMESH_NUM_BLOCKS": str(num_blocks),
        "KVMESH_BLOCK_SIZE": str(block_size),
        "KVMESH_WORKER_ID": name,
        "KVMESH_LOG_LEVEL": "warning",
        "PYTHONUNBUFFERED": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "KVMESH_MAX_NUM_BATCHED_TOKENS": "2048",
        **env,
    }
    argv = (sys.executable, "-m", f"services.{role}.main")
    return ProcessSpec(name, role, argv, env, "127.0.0.1", port, metrics_port, "cpu", workdir=REPO_ROOT)


def raw_tcp_s(nbytes: int) -> float:
    """Seconds to copy ``nbytes`` over a loopback TCP socket (sender thread -> receiver)."""
    payload = bytes(nbytes)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(payload)

        t = threading.Thread(target=send)
        t0 = time.perf_counter()
        t.start()
        conn, _ = srv.accept()
        got, buf = 0, bytearray(1 << 20)
        with conn:
            while got < nbytes:
                k = conn.recv_into(buf)
                if not k:
                    break
                got += k
        dt = time.perf_counter() - t0
        t.join()
    assert got == nbytes
    return dt


def greedy(n: int) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@dataclasses.dataclass
class Pair:
    transport: str
    prefill: prefill_pb2_grpc.PrefillServiceStub
    decode: decode_pb2_grpc.DecodeServiceStub


@dataclasses.dataclass
class HandOff:
    blocks: int
    prefill_ns: int
    transfer_ns: int
    ttft_ns: int


async def hand_off(pair: Pair, rid: str, prompt: list[int]) -> HandOff:
    """Prefill ``prompt``, decode it remotely; TTFT = the Prefill call + decode's first token."""
    t0 = time.perf_counter_ns()
    pre = await pair.prefill.Prefill(prefill_pb2.PrefillRequest(request_id=rid, token_ids=prompt, sampling=greedy(2)))
    prefill_ns = time.perf_counter_ns() - t0
    if pair.transport != "grpc":
        assert pre.handoff.HasField("nixl"), "the prefill worker did not offer its blocks over NIXL"
    remote = decode_pb2.RemotePrefill(first_token_id=pre.first_token_id, handoff=pre.handoff)
    ttft_ns = final = None
    async for msg in pair.decode.Decode(
        decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=greedy(2), remote=remote)
    ):
        ttft_ns = ttft_ns or time.perf_counter_ns() - t0
        if msg.HasField("final"):
            final = msg.final
    return HandOff(len(pre.handoff.block_hashes), prefill_ns, final.timings.transfer_ns, ttft_ns)


async def seed(store: kvstore_pb2_grpc.KVStoreServiceStub, engine: LLMEngine, prompt: list[int]) -> None:
    """Random KV (normal floats: no NaN reaches the sampler) under each of ``prompt``'s block hashes."""
    g = torch.Generator().manual_seed(len(prompt))
    samples = [torch.randn(engine.kv.block_shape, generator=g).to(engine.kv.dtype) for _ in range(4)]
    payloads = [
        BlockPayload(engine.kv.block_shape, dtype_name(engine.kv.dtype), t.view(torch.uint8).numpy().tobytes())
        for t in samples
    ]

    def chunks():
        for i, h in enumerate(engine.prompt_block_hashes(prompt)):
            for chunk in block_to_chunks(h, payloads[i % len(payloads)]):
                yield kvstore_pb2.PutRequest(chunk=chunk)

    await store.Put(chunks())


async def fill(prefill: prefill_pb2_grpc.PrefillServiceStub, rid: str, prompt: list[int]) -> None:
    """Bring ``prompt``'s KV into the prefill worker (from the kvstore; no decode worker sees it)."""
    pre = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id=rid, token_ids=prompt, sampling=greedy(2)))
    assert pre.computed_tokens == 1, f"{pre.computed_tokens} tokens computed: the kvstore did not serve the prompt"
    await prefill.ReleaseLease(prefill_pb2.ReleaseLeaseRequest(lease_id=pre.handoff.lease_id))


def prompts_for(blocks: int, block_size: int, decode_pool: int, seed: int) -> list[list[int]]:
    """Enough distinct prompts of ``blocks`` full blocks (plus one token) that cycling through
    them overflows decode's pool: each comes back only after LRU evicted it."""
    count = decode_pool // blocks + 1
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (blocks * block_size + 1,), generator=g).tolist() for _ in range(count)]


def checksum_gbps(block_size: int, model: Path) -> float:
    """CRC-32 over pool blocks as both ends compute it (KVCache.block_checksum), GB/s."""
    engine = LLMEngine(model, EngineConfig(num_blocks=256, block_size=block_size))
    engine.kv.tensor.normal_()
    t0 = time.perf_counter()
    for b in range(256):
        engine.kv.block_checksum(b)
    return 256 * engine.kv.block_nbytes / (time.perf_counter() - t0) / 1e9


async def measure_block_size(
    mesh: Mesh, args: argparse.Namespace, engine: LLMEngine, decode_pool: int
) -> tuple[list[dict], dict]:
    block_size, block_nbytes = engine.config.block_size, engine.kv.block_nbytes
    channels = []

    def stub(kind, name, role="gateway"):
        channels.append(create_channel(mesh.address(name), mesh.identity(role)))
        return kind(channels[-1])

    pairs = [
        Pair(
            t,
            stub(prefill_pb2_grpc.PrefillServiceStub, "prefill-tcp" if t == "nixl_tcp" else "prefill"),
            stub(decode_pb2_grpc.DecodeServiceStub, f"decode-{t}"),
        )
        for t in TRANSPORTS
    ]
    store = stub(kvstore_pb2_grpc.KVStoreServiceStub, "kvstore", "decode")
    try:
        warm = torch.randint(1, VOCAB, (4 * block_size + 1,)).tolist()
        for pair in pairs:  # handshakes, connections, first-call costs
            await hand_off(pair, f"warm-{pair.transport}", warm)
        cells = []
        for blocks in args.blocks:
            prompts = prompts_for(blocks, block_size, decode_pool, seed=blocks)
            for i, prompt in enumerate(prompts):  # each prompt's KV once into both prefill workers
                await seed(store, engine, prompt)
                for p, name in ((pairs[0].prefill, "main"), (pairs[2].prefill, "tcp")):
                    await fill(p, f"fill-{blocks}-{i}-{name}", prompt)
            gbps: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
            raw: list[float] = []
            for t in range(args.trials):
                for pair in pairs if t % 2 == 0 else pairs[::-1]:  # none always goes first
                    # Each decode worker cycles through more prompts than its pool holds: by the
                    # time one comes round again LRU has evicted it, so every block moves.
                    prompt = prompts[t % len(prompts)]
                    h = await hand_off(pair, f"c{blocks}-{pair.transport}-{t}", prompt)
                    assert h.blocks == blocks
                    gbps[pair.transport].append(blocks * block_nbytes / h.transfer_ns)
                raw.append(blocks * block_nbytes / raw_tcp_s(blocks * block_nbytes) / 1e9)
            raw_p50 = statistics.median(raw)
            cell = {
                "block_size": block_size,
                "blocks": blocks,
                "block_bytes": block_nbytes,
                "bytes": blocks * block_nbytes,
                "raw_tcp_gbps": raw_p50,
                "raw_tcp_samples": raw,
            }
            for transport, values in gbps.items():
                p50 = statistics.median(values)
                cell[transport] = {"gbps": p50, "ratio": p50 / raw_p50, "samples": values}
            cells.append(cell)
        ttft = {}
        if args.ttft_tokens and block_size == args.block_sizes[0]:
            g = torch.Generator().manual_seed(7)
            for pair in pairs:
                prompt = torch.randint(1, VOCAB, (args.ttft_tokens,), generator=g).tolist()
                h = await hand_off(pair, f"ttft-{pair.transport}", prompt)
                ttft[pair.transport] = {
                    "tokens": args.ttft_tokens,
                    "blocks": h.blocks,
                    "prefill_ms": h.prefill_ns / 1e6,
                    "transfer_ms": h.transfer_ns / 1e6,
                    "ttft_ms": h.ttft_ns / 1e6,
                }
        return cells, ttft
    finally:
        for ch in channels:
            await ch.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 512], help="blocks per hand-off, one cell each")
    ap.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        default=[16, 8, 64],
        help="tokens per KV block (16: 192 KiB blocks, 8: 96 KiB, 64: 768 KiB); the first also runs the TTFT",
    )
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--ttft-tokens", type=int, default=8000, help="prompt of the TTFT run (0: skip it)")
    ap.add_argument("--json", default="bench/results/kv_transfer.json")
    args = ap.parse_args()
    cells: list[dict] = []
    ttft: dict = {}
    checksums: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        max_tokens = max(max(args.blocks) * max(args.block_sizes), args.ttft_tokens) + 64
        model = Path(tmp) / "llama"
        write_model(model, max_tokens)
        for bs in args.block_sizes:
            engine = LLMEngine(model, EngineConfig(num_blocks=1, block_size=bs))
            block_nbytes = engine.kv.block_nbytes
            checksums[bs] = checksum_gbps(bs, model)
            biggest = max(max(args.blocks), -(-args.ttft_tokens // bs) if bs == args.block_sizes[0] else 0)
            decode_pool = biggest + MARGIN_BLOCKS
            # Prefill keeps every prompt of the largest cell (and the others) cached.
            prefill_pool = sum((decode_pool // b + 1) * (b + 1) for b in args.blocks) + biggest + 2 * MARGIN_BLOCKS
            store = kvstore("kvstore", 2 * prefill_pool * block_nbytes)
            via_store = {"KVMESH_KVSTORE_ADDRESS": f"{store.host}:{store.port}"}
            specs = [
                store,
                worker("prefill", "prefill", model, prefill_pool, bs, {"KVMESH_KV_TRANSPORT": "nixl", **via_store}),
                worker(
                    "prefill-tcp",
                    "prefill",
                    model,
                    prefill_pool,
                    bs,
                    {"KVMESH_KV_TRANSPORT": "nixl", **TCP_ONLY, **via_store},
                ),
                worker("decode-grpc", "decode", model, decode_pool, bs, {"KVMESH_KV_TRANSPORT": "grpc"}),
                worker("decode-nixl", "decode", model, decode_pool, bs, {"KVMESH_KV_TRANSPORT": "nixl"}),
                worker(
                    "decode-nixl_tcp", "decode", model, decode_pool, bs, {"KVMESH_KV_TRANSPORT": "nixl", **TCP_ONLY}
                ),
            ]
            with Mesh(Topology(tuple(specs)), Path(tmp) / f"run-{bs}") as mesh:
                c, t = asyncio.run(measure_block_size(mesh, args, engine, decode_pool))
            cells += c
            ttft.update(t)
    print(
        f"KV transfer prefill -> decode vs raw loopback TCP (same bytes, same run), median of {args.trials} trials;\n"
        "grpc/nixl/nixl_tcp verify every block's CRC-32 inside their time, raw TCP is the bare copy (no checksum)"
    )
    headers = [
        "block tokens",
        "blocks",
        "MiB",
        "raw TCP GB/s",
        *(f"{t} GB/s" for t in TRANSPORTS),
        *(f"{t} ratio" for t in TRANSPORTS),
    ]
    rows = [
        [
            c["block_size"],
            c["blocks"],
            f"{c['bytes'] / 2**20:.0f}",
            f"{c['raw_tcp_gbps']:.2f}",
            *(f"{c[t]['gbps']:.2f}" for t in TRANSPORTS),
            *(f"{c[t]['ratio']:.2f}" for t in TRANSPORTS),
        ]
        for c in cells
    ]
    print_table(headers, rows)
    if ttft:
        print(f"\nTTFT of one {args.ttft_tokens}-token prompt (Prefill call + decode's first token; transfer inside)")
        print_table(
            ["transport", "blocks", "prefill ms", "transfer ms", "TTFT ms"],
            [
                [t, v["blocks"], f"{v['prefill_ms']:.0f}", f"{v['transfer_ms']:.1f}", f"{v['ttft_ms']:.0f}"]
                for t, v in ttft.items()
            ],
        )
    print(
        "\nblock checksum (CRC-32, each end once per block): "
        + ", ".join(f"{bs}-token blocks {g:.2f} GB/s" for bs, g in checksums.items())
    )
    for (
        c
    ) in cells:  # what verification adds to each transfer at that rate (decode's end; prefill's is before its answer)
        ms = c["bytes"] / checksums[c["block_size"]] / 1e6
        c["checksum_ms"] = ms
        print(f"  {c['blocks']} blocks of {c['block_size']} tokens: {ms:.1f} ms per end")
    write_json(args.json, {"cells": cells, "ttft": ttft, "checksum_gbps": checksums, "trials": args.trials})
    return 0


if __name__ == "__main__":
    sys.exit(main())
