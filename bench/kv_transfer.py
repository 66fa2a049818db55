"""KV transfer prefill -> decode vs a raw loopback TCP copy of the same bytes, same run.

Starts one prefill and one decode worker as real processes (no router: this
script plays the gateway's part). Each trial prefills a fresh prompt and hands
it to decode, which pulls the prompt's full blocks over PullKV and imports
them; the time is decode's own ``DecodeFinal.timings.transfer_ns`` (missing-block
lookup, pull, checksums, import, lease release). After each round a raw TCP
copy of the same byte count runs, so both sides of the ratio see the same
machine load; the ratio of medians is the result.

Two conditions: decode idle, and decode busy with other sequences (every
engine-thread call then waits for the running step to end).

``--compare-with DIR`` also starts a pair from another checkout (e.g. the last
commit: ``git archive HEAD | tar -x -C /tmp/base``) and alternates trials
between the two, for a before/after under the same load. In the idle condition
it also reports the CPU both processes spent per transfer (during the decode
call, which includes decoding its two tokens): steadier than wall time on a
shared machine.

Run: ``python bench/kv_transfer.py [--tokens 2048] [--trials 8] [--compare-with DIR] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
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
from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402

from kvmesh.common.v1 import sampling_pb2  # noqa: E402
from kvmesh.decode.v1 import decode_pb2, decode_pb2_grpc  # noqa: E402
from kvmesh.engine import EngineConfig, LLMEngine  # noqa: E402
from kvmesh.launcher.supervisor import Mesh  # noqa: E402
from kvmesh.launcher.topology import REPO_ROOT, ProcessSpec, Topology, free_port  # noqa: E402
from kvmesh.prefill.v1 import prefill_pb2, prefill_pb2_grpc  # noqa: E402

VOCAB = 2048
BUSY_STREAMS = 4
_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def write_model(path: Path) -> None:
    """The same shape as bench/mesh.py's model: 6 layers, 4 KV heads of 64, fp32 -> 192 KiB blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8192,
        initializer_range=0.1, eos_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def worker(role: str, label: str, checkout: Path, model: Path, num_blocks: int, block_size: int = 16) -> ProcessSpec:
    port, metrics_port = free_port(), free_port()
    env = {
        "KVMESH_HOST": "127.0.0.1", "KVMESH_PORT": str(port), "KVMESH_METRICS_PORT": str(metrics_port),
        "KVMESH_MODEL": str(model), "KVMESH_NUM_BLOCKS": str(num_blocks), "KVMESH_BLOCK_SIZE": str(block_size),
        "KVMESH_WORKER_ID": f"{role}-{label}",
        "KVMESH_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE",
    }
    # `python -m services.<role>.main` from ``checkout`` runs that checkout's code.
    argv = (sys.executable, "-m", f"services.{role}.main")
    return ProcessSpec(f"{role}-{label}", role, argv, env, "127.0.0.1", port, metrics_port, "cpu", workdir=checkout)


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


def cpu_ms(pid: int) -> float:
    """User + system CPU a process (all its threads) has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_MS


def greedy(n: int) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@dataclasses.dataclass
class Pair:
    label: str
    prefill: prefill_pb2_grpc.PrefillServiceStub
    decode: decode_pb2_grpc.DecodeServiceStub
    pids: tuple[int, int]


async def hand_off(pair: Pair, rid: str, prompt: list[int]) -> tuple[int, int, float]:
    """Prefill ``prompt``, decode it remotely: (blocks handed off, decode's transfer ns, CPU ms)."""
    pre = await pair.prefill.Prefill(prefill_pb2.PrefillRequest(request_id=rid, token_ids=prompt, sampling=greedy(2)))
    remote = decode_pb2.RemotePrefill(first_token_id=pre.first_token_id, handoff=pre.handoff)
    cpu0 = sum(map(cpu_ms, pair.pids))
    final = None
    async for msg in pair.decode.Decode(
        decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=greedy(2), remote=remote)
    ):
        if msg.HasField("final"):
            final = msg.final
    return len(pre.handoff.block_hashes), final.timings.transfer_ns, sum(map(cpu_ms, pair.pids)) - cpu0


async def keep_busy(decode, stop: asyncio.Event, name: str, seed: int) -> None:
    """A local-prefill stream on decode, restarted until ``stop``: keeps its engine stepping."""
    g = torch.Generator().manual_seed(seed)
    i = 0
    while not stop.is_set():
        prompt = torch.randint(1, VOCAB, (32,), generator=g).tolist()
        call = decode.Decode(decode_pb2.DecodeRequest(
            request_id=f"busy-{name}-{i}", prompt_token_ids=prompt, sampling=greedy(200), local={}
        ))
        async for _ in call:
            if stop.is_set():
                call.cancel()
                break
        i += 1


async def measure(pairs: list[Pair], args: argparse.Namespace, block_nbytes: int) -> dict:
    g = torch.Generator().manual_seed(1)
    for pair in pairs:
        await hand_off(pair, "warm-up", torch.randint(1, VOCAB, (64,), generator=g).tolist())
    result: dict = {}
    for condition in ("idle", "busy"):
        stop = asyncio.Event()
        busy = [
            asyncio.create_task(keep_busy(p.decode, stop, f"{p.label}-{s}", s))
            for p in pairs for s in range(BUSY_STREAMS if condition == "busy" else 0)
        ]
        await asyncio.sleep(0.5 if busy else 0)
        gbps: dict[str, list[float]] = {p.label: [] for p in pairs}
        cpu: dict[str, list[float]] = {p.label: [] for p in pairs}
        raw: list[float] = []
        try:
            for t in range(args.trials):
                for pair in pairs if t % 2 == 0 else pairs[::-1]:  # neither always goes first
                    prompt = torch.randint(1, VOCAB, (args.tokens,), generator=g).tolist()
                    blocks, ns, cpu_used = await hand_off(pair, f"{condition}-{pair.label}-{t}", prompt)
                    nbytes = blocks * block_nbytes
                    gbps[pair.label].append(nbytes / ns)
                    cpu[pair.label].append(cpu_used)
                raw.append(nbytes / raw_tcp_s(nbytes) / 1e9)
        finally:
            stop.set()
            await asyncio.gather(*busy)
        raw_p50 = statistics.median(raw)
        result[condition] = {"bytes": nbytes, "raw_tcp_gbps": raw, "raw_tcp_p50_gbps": raw_p50, "checkouts": {}}
        for label, values in gbps.items():
            p50 = statistics.median(values)
            result[condition]["checkouts"][label] = {
                "mesh_gbps": values, "mesh_p50_gbps": p50, "ratio_p50": p50 / raw_p50,
                # With busy decode engines the CPU is mostly theirs: reported idle only.
                "cpu_ms_per_transfer": statistics.median(cpu[label]) if condition == "idle" else None,
            }
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length; its full blocks are transferred")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16: 192 KiB blocks, 64: 768 KiB)")
    ap.add_argument("--compare-with", type=Path, help="another checkout to run beside this one (before/after)")
    ap.add_argument("--json", default="bench/results/kv_transfer.json")
    args = ap.parse_args()
    # A prompt in flight, the next, and the busy streams' blocks.
    num_blocks = 3 * (args.tokens // args.block_size + 1) + 4096 // args.block_size
    checkouts = {"this": REPO_ROOT}
    if args.compare_with:
        checkouts["other"] = args.compare_with.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama"
        write_model(model)
        block_nbytes = LLMEngine(model, EngineConfig(num_blocks=1, block_size=args.block_size)).kv.block_nbytes
        specs = [
            worker(role, label, root, model, num_blocks, args.block_size)
            for label, root in checkouts.items()
            for role in ("prefill", "decode")
        ]
        with Mesh(Topology(tuple(specs)), Path(tmp) / "run") as mesh:

            async def run() -> dict:
                channels = [grpc.aio.insecure_channel(mesh.address(f"{role}-{label}"))
                            for label in checkouts for role in ("prefill", "decode")]
                try:
                    pairs = [
                        Pair(label, prefill_pb2_grpc.PrefillServiceStub(channels[2 * i]),
                             decode_pb2_grpc.DecodeServiceStub(channels[2 * i + 1]),
                             (mesh.process(f"prefill-{label}").pid, mesh.process(f"decode-{label}").pid))
                        for i, label in enumerate(checkouts)
                    ]
                    return await measure(pairs, args, block_nbytes)
                finally:
                    for ch in channels:
                        await ch.close()

            result = asyncio.run(run())
    print(f"KV transfer prefill -> decode ({args.tokens}-token prompts, {block_nbytes} B blocks) "
          f"vs raw loopback TCP, same bytes, {args.trials} trials each")
    if args.compare_with:
        print(f"checkouts: this = {REPO_ROOT}, other = {checkouts['other']}")
    rows = []
    for condition, r in result.items():
        for label, c in r["checkouts"].items():
            cpu = "" if c["cpu_ms_per_transfer"] is None else f"{c['cpu_ms_per_transfer']:.0f}"
            rows.append([condition, label, r["bytes"], f"{c['mesh_p50_gbps']:.3f}", f"{r['raw_tcp_p50_gbps']:.3f}",
                         f"{c['ratio_p50']:.2f}", cpu])
    headers = ["decode engine", "checkout", "bytes", "mesh p50 GB/s", "raw TCP p50 GB/s", "ratio", "CPU ms/transfer"]
    print_table(headers, rows)
    checkout_paths = {k: str(v) for k, v in checkouts.items()}
    write_json(args.json, {"tokens": args.tokens, "block_bytes": block_nbytes, "checkouts": checkout_paths, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
