"""The mesh's cost over the engine, KV transfer speed, and speculation — each against an anchor
measured in the same run.

(a) TTFT and time per output token through the full mesh (gateway -> router -> prefill ->
    decode, real processes, real Redis) vs the in-process engine (AsyncEngine), 1 and 8
    concurrent streams: the mesh's overhead per token is the difference of the medians.
(b) KV transfer prefill -> decode in GB/s (decode's measured pull + import time for the
    prompt's blocks) vs a raw loopback TCP copy of the same number of bytes.
(c) Speculation on vs off through the mesh on repeated traffic: accepted tokens per decode
    step and the decode speed-up.

Run: ``python bench/mesh.py [--json PATH]``. Prints tables, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _table import print_table  # noqa: E402

from kvmesh.api.common.v1 import sampling_pb2  # noqa: E402
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from kvmesh.engine.async_engine import AsyncEngine  # noqa: E402
from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.launcher.spec import MeshOptions  # noqa: E402
from kvmesh.launcher.supervisor import Mesh  # noqa: E402
from kvmesh.launcher.topology import build_topology  # noqa: E402
from kvmesh.models.bpe import train_tokenizer, write_tokenizer  # noqa: E402
from kvmesh.sampling import SamplingParams  # noqa: E402

NUM_BLOCKS = 512


def write_model(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        initializer_range=0.1,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok = path.parent / "tok"
    tok.mkdir()
    write_tokenizer(train_tokenizer(2048, corpus_bytes=300_000), tok)
    for f in tok.iterdir():
        shutil.copy(f, path / f.name)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 2048, (length,), generator=g).tolist() for _ in range(n)]


def _stats(streams: list[list[float]]) -> dict:
    """Per-stream token arrival times (s from request start) -> TTFT and time per output token.

    Time per output token is each stream's (last - first) / (tokens - 1), medianed over streams:
    single inter-token gaps are not comparable, because a busy process hands several ready
    tokens to gRPC at once and they arrive back to back (gaps of microseconds, then one long).
    """
    ttft = [s[0] for s in streams]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in streams]
    return {"ttft_p50_ms": statistics.median(ttft) * 1e3, "itl_p50_ms": statistics.median(tpot) * 1e3}


async def engine_streams(model: Path, batch: list[list[int]], n: int) -> list[list[float]]:
    engine = await AsyncEngine.started(lambda: LLMEngine(model, EngineConfig(num_blocks=NUM_BLOCKS)))
    try:

        async def one(i: int, p: list[int]) -> list[float]:
            t0, times = time.perf_counter(), []
            async for out in engine.generate(
                p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), f"r{i}"
            ):
                times += [time.perf_counter() - t0] * len(out.new_token_ids)
            return times

        await one(-1, batch[0][:8])  # warm-up
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    finally:
        engine.stop()


async def mesh_streams(gateway, batch: list[list[int]], n: int) -> tuple[list[list[float]], list, list[list[int]]]:
    """Per stream: token arrival times, the final message, the tokens."""

    async def one(p: list[int]):
        t0, times, final, tokens = time.perf_counter(), [], None, []
        req = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=p),
            sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        )
        async for msg in gateway.Generate(req):
            times += [time.perf_counter() - t0] * len(msg.token_ids)
            tokens += msg.token_ids
            if msg.HasField("final"):
                final = msg.final
        return times, final, tokens

    results = await asyncio.gather(*(one(p) for p in batch))
    return [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]


def raw_tcp_gbps(nbytes: int, repeats: int = 3) -> float:
    """Best of a few loopback TCP copies of ``nbytes`` (sender thread -> receiver), GB/s."""
    payload = bytes(nbytes)
    best = 0.0
    for _ in range(repeats):
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(payload)

        t = threading.Thread(target=send)
        t0 = time.perf_counter()
        t.start()
        conn, _ = srv.accept()
        got, buf = 0, bytearray(1 << 20)
        while got < nbytes:
            k = conn.recv_into(buf)
            if not k:
                break
            got += k
        dt = time.perf_counter() - t0
        t.join()
        conn.close()
        srv.close()
        best = max(best, got / dt / 1e9)
    return best


def start(model: Path, run_dir: Path, spec_tokens: int) -> Mesh:
    env = {
        "router": {"KVMESH_LOCAL_PREFILL_MAX_UNCACHED_TOKENS": "0", "KVMESH_LOCAL_PREFILL_MIN_HIT_FRACTION": "2"},
        "prefill": {"KVMESH_NUM_BLOCKS": str(NUM_BLOCKS)},
        "decode": {"KVMESH_NUM_BLOCKS": str(NUM_BLOCKS), "KVMESH_NUM_SPECULATIVE_TOKENS": str(spec_tokens)},
    }
    opts = MeshOptions(model=model, gateway_port=0, role_env=env, log_level="warning", speculator=spec_tokens > 0)
    return Mesh(build_topology(opts, run_dir), run_dir).start()


async def run(args: argparse.Namespace, model: Path, tmp: Path) -> dict:
    result: dict = {"latency": {}, "transfer": {}, "speculation": {}}
    mesh = start(model, tmp / "mesh", 0)
    try:
        async with grpc.aio.insecure_channel(mesh.address("gateway")) as ch:
            gw = gateway_pb2_grpc.GatewayServiceStub(ch)
            await mesh_streams(gw, prompts(1, 16, 99), 4)  # warm-up
            for conc in (1, 8):
                batch = prompts(conc, 64, conc)
                eng = _stats(await engine_streams(model, batch, args.new_tokens))
                msh = _stats((await mesh_streams(gw, batch, args.new_tokens))[0])
                result["latency"][conc] = {
                    "engine": eng,
                    "mesh": msh,
                    "overhead_per_token_ms": msh["itl_p50_ms"] - eng["itl_p50_ms"],
                    "ttft_overhead_ms": msh["ttft_p50_ms"] - eng["ttft_p50_ms"],
                }
            # (b) one long prompt: its full blocks cross from prefill to decode.
            long_prompt = prompts(1, args.transfer_tokens, 7)
            _, finals, _ = await mesh_streams(gw, long_prompt, 2)
            layout = LLMEngine(model, EngineConfig(num_blocks=4)).kv
            nbytes = (args.transfer_tokens // 16) * layout.block_nbytes
            gbps = nbytes / finals[0].decode_timings.transfer_ns if finals[0].decode_timings.transfer_ns else 0.0
            raw = raw_tcp_gbps(nbytes)
            result["transfer"] = {"bytes": nbytes, "mesh_gbps": gbps, "raw_tcp_gbps": raw, "ratio": gbps / raw}
            off = await speculation_run(gw, args)
    finally:
        mesh.stop()
    mesh = start(model, tmp / "mesh-spec", 4)
    try:
        async with grpc.aio.insecure_channel(mesh.address("gateway")) as ch:
            on = await speculation_run(gateway_pb2_grpc.GatewayServiceStub(ch), args)
    finally:
        mesh.stop()
    result["speculation"] = {
        "off": off,
        "on": on,
        "identical": off["tokens"] == on["tokens"],
        "speedup": off["decode_s"] / on["decode_s"],
    }
    for r in (off, on):
        r.pop("tokens")
    return result


async def speculation_run(gw, args) -> dict:
    """Repeated traffic: the same prompt three times; the last run is measured."""
    prompt = prompts(1, 48, 5)[0]
    for _ in range(3):
        streams, _, tokens = await mesh_streams(gw, [prompt], args.new_tokens)
    times = streams[0]
    steps = len(set(times))  # tokens that arrived in one message came from one step
    return {
        "tokens": tokens[0],
        "decode_s": times[-1] - times[0],
        "tokens_per_step": len(times) / steps,
        "accepted_per_step": (len(times) - steps) / steps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--transfer-tokens", type=int, default=2048)
    ap.add_argument("--json", default="bench/results/mesh.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model" / "llama"
        write_model(model)
        result = asyncio.run(run(args, model, Path(tmp)))

    print("(a) latency: in-process engine vs full mesh, greedy, 64-token prompts")
    print_table(
        [
            "streams",
            "engine TTFT p50 ms",
            "mesh TTFT p50 ms",
            "engine ms/token p50",
            "mesh ms/token p50",
            "overhead/token ms",
        ],
        [
            [
                c,
                f"{r['engine']['ttft_p50_ms']:.1f}",
                f"{r['mesh']['ttft_p50_ms']:.1f}",
                f"{r['engine']['itl_p50_ms']:.2f}",
                f"{r['mesh']['itl_p50_ms']:.2f}",
                f"{r['overhead_per_token_ms']:.2f}",
            ]
            for c, r in result["latency"].items()
        ],
    )
    t = result["transfer"]
    print("\n(b) KV transfer prefill -> decode vs raw loopback TCP, same bytes")
    print_table(
        ["bytes", "mesh GB/s", "raw TCP GB/s", "ratio"],
        [[t["bytes"], f"{t['mesh_gbps']:.3f}", f"{t['raw_tcp_gbps']:.3f}", f"{t['ratio']:.2f}"]],
    )
    s = result["speculation"]
    print("\n(c) speculation through the mesh on repeated traffic")
    print_table(
        ["run", "decode s", "tokens/step", "accepted/step"],
        [
            [k, f"{s[k]['decode_s']:.3f}", f"{s[k]['tokens_per_step']:.2f}", f"{s[k]['accepted_per_step']:.2f}"]
            for k in ("off", "on")
        ],
    )
    print(f"speed-up: {s['speedup']:.2f}x   identical output: {s['identical']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
