"""Where a stream's token time goes between the engine and the client, hop by hop.

The same greedy requests (``--streams`` chat prompts on the real default model, N new tokens
each, EOS ignored, all at once) are streamed at four depths, alternating, in one run:

  engine    the in-process AsyncEngine in this process (the anchor; the mesh idles meanwhile);
  decode    decode's gRPC ``Decode`` stream, straight to the worker (it prefills locally);
  gateway   the gateway's gRPC ``Generate`` (router decision, then the decode stream);
  http      the gateway's OpenAI ``/v1/completions`` with ``stream: true`` (SSE).

For each depth: time per output token (median over streams and repeats of (last - first) /
(n - 1)), TTFT, tokens/s of one stream (1 / time per token) and of all of them (tokens / wall
time, prefill included), what that depth adds per token over the one before it, and the CPU
time each process spent per token (from /proc: on a 2-core machine, every CPU-millisecond a
hop burns is taken from the engine's matmul threads). Run:
``python bench/hops.py [--topology colocated|compose] [--streams 1] [--dtype float32] [--compile] [--new-tokens 128]
[--repeats 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _table import print_table  # noqa: E402
from engine import chat_prompts  # noqa: E402

from kvmesh.api.common.v1 import sampling_pb2  # noqa: E402
from kvmesh.api.decode.v1 import decode_pb2, decode_pb2_grpc  # noqa: E402
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from kvmesh.engine.async_engine import AsyncEngine  # noqa: E402
from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.launcher.spec import MeshOptions  # noqa: E402
from kvmesh.launcher.supervisor import Mesh  # noqa: E402
from kvmesh.launcher.topology import build_topology  # noqa: E402
from kvmesh.runtime import create_channel
from kvmesh.runtime.ports import free_port  # noqa: E402
from kvmesh.sampling import SamplingParams  # noqa: E402

DEPTHS = ("engine", "decode", "gateway", "http")
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


@dataclass
class Round:
    """One depth's streams, sent together."""

    arrivals: list[list[float]]  # per stream: seconds from the round's start, one per token
    wall_s: float
    cpu_s: dict[str, float]  # process -> CPU seconds during the round

    @property
    def tpots_s(self) -> list[float]:
        return [(a[-1] - a[0]) / (len(a) - 1) for a in self.arrivals]

    @property
    def tokens(self) -> int:
        return sum(len(a) for a in self.arrivals)


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


async def arrivals(messages: AsyncIterator, t0: float, tokens_in: Callable[[object], int]) -> list[float]:
    """Seconds since ``t0`` at which each token arrived: a message's tokens all count at its arrival."""
    times: list[float] = []
    async for msg in messages:
        times += [time.perf_counter() - t0] * tokens_in(msg)
    return times


class Depths:
    """One streaming call per depth, each returning token arrival times."""

    def __init__(self, mesh: Mesh, engine: AsyncEngine, http_port: int, new_tokens: int) -> None:
        self.mesh, self.engine, self.n = mesh, engine, new_tokens
        self.http_url = f"http://127.0.0.1:{http_port}/v1/completions"
        self._count = 0
        self.model_id = ""

    async def prepare(self) -> None:
        async with aiohttp.ClientSession() as s, s.get(self.http_url.replace("/completions", "/models")) as resp:
            self.model_id = (await resp.json())["data"][0]["id"]

    def _rid(self) -> str:
        self._count += 1
        return f"hops-{self._count}"

    def _sampling(self) -> sampling_pb2.SamplingParams:
        return sampling_pb2.SamplingParams(
            temperature=0.0,
            max_tokens=self.n,
            ignore_eos=True,
            repetition_penalty=1.0,
            repetition_guard=sampling_pb2.RepetitionGuard(max_repeats=0),
        )

    async def engine_stream(self, prompt: list[int], t0: float) -> list[float]:
        outs = self.engine.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=self.n, ignore_eos=True), self._rid()
        )
        return await arrivals(outs, t0, lambda out: len(out.new_token_ids))

    async def decode_stream(self, prompt: list[int], t0: float) -> list[float]:
        req = decode_pb2.DecodeRequest(
            request_id=self._rid(), prompt_token_ids=prompt, sampling=self._sampling(), local=decode_pb2.LocalPrefill()
        )
        async with create_channel(self.mesh.address("decode-0"), self.mesh.identity("gateway")) as ch:
            return await arrivals(decode_pb2_grpc.DecodeServiceStub(ch).Decode(req), t0, lambda m: len(m.token_ids))

    async def gateway_stream(self, prompt: list[int], t0: float) -> list[float]:
        req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=self._sampling())
        async with grpc.aio.insecure_channel(self.mesh.address("gateway")) as ch:
            stream = gateway_pb2_grpc.GatewayServiceStub(ch).Generate(req)
            return await arrivals(stream, t0, lambda m: len(m.token_ids))

    async def http_stream(self, prompt: list[int], t0: float) -> list[float]:
        chunks: list[float] = []
        tokens = 0
        async with aiohttp.ClientSession() as s:
            body = {
                "model": self.model_id,
                "prompt": prompt,
                "max_tokens": self.n,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": True,
                "repetition_penalty": 1.0,
                "stream_options": {"include_usage": True},
            }
            resp = await s.post(self.http_url, json=body)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"]:
                    chunks.append(time.perf_counter() - t0)
            resp.release()
        # Chunks carry the text of one decode message each; extra tokens count at the last arrival.
        if len(chunks) < tokens:
            chunks += [chunks[-1]] * (tokens - len(chunks))
        return chunks

    async def run(self, depth: str, prompts: list[list[int]], pids: dict[str, int]) -> Round:
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        t0 = time.perf_counter()
        stream = getattr(self, f"{depth}_stream")
        arrivals = await asyncio.gather(*(stream(prompt, t0) for prompt in prompts))
        wall = time.perf_counter() - t0
        cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        for got in arrivals:
            if len(got) != self.n:
                raise RuntimeError(f"{depth}: {len(got)} tokens, expected {self.n}")
        return Round(list(arrivals), wall, cpu)


def start_mesh(model: Path, run_dir: Path, args: argparse.Namespace, http_port: int) -> Mesh:
    # colocated: decode prefills itself, as `kvmesh up --prefill 0 --no-speculator`;
    # compose: the compose file's mesh (prefill workers, kvstore), as `kvmesh up --no-speculator`.
    worker = {"KVMESH_DTYPE": args.dtype, "KVMESH_COMPILE": str(int(args.compile))}
    env = {"prefill": worker, "decode": worker, "gateway": {"KVMESH_HTTP_PORT": str(http_port)}}
    prefill = 0 if args.topology == "colocated" else None
    opts = MeshOptions(
        model=model,
        prefill=prefill,
        decode=1,
        speculator=False,
        gateway_port=0,
        publish=False,
        role_env=env,
        log_level="warning",
    )
    return Mesh(build_topology(opts, run_dir), run_dir).start()


async def measure(args: argparse.Namespace, model: Path, tmp: Path) -> dict:
    prompts = chat_prompts(model, args.streams)
    http_port = free_port()
    mesh = start_mesh(model, tmp / "mesh", args, http_port)
    engine = await AsyncEngine.started(lambda: LLMEngine(model, EngineConfig(dtype=args.dtype, compile=args.compile)))
    try:
        depths = Depths(mesh, engine, http_port, args.new_tokens)
        pids = {p.name: mesh.process(p.name).pid for p in mesh.topology.processes if p.role != "redis"}
        pids["bench"] = os.getpid()
        await depths.prepare()
        for depth in DEPTHS:  # warm-up: the first request of each path pays one-off costs
            await depths.run(depth, [p[:8] for p in prompts], pids)
        runs: dict[str, list[Round]] = {d: [] for d in DEPTHS}
        for _ in range(args.repeats):
            for depth in DEPTHS:
                runs[depth].append(await depths.run(depth, prompts, pids))
    finally:
        engine.stop()
        mesh.stop()
    return summarize(runs)


def summarize(runs: dict[str, list[Round]]) -> dict:
    out: dict = {}
    prev = None
    for depth, rounds in runs.items():
        tpot = statistics.median(t for r in rounds for t in r.tpots_s)
        cpu = {name: statistics.median(r.cpu_s[name] / r.tokens for r in rounds) * 1e3 for name in rounds[0].cpu_s}
        out[depth] = {
            "tpot_ms": tpot * 1e3,
            "ttft_ms": statistics.median(a[0] for r in rounds for a in r.arrivals) * 1e3,
            "tokens_per_s": 1 / tpot,
            "total_tokens_per_s": statistics.median(r.tokens / r.wall_s for r in rounds),
            "added_ms_per_token": None if prev is None else (tpot - prev) * 1e3,
            "cpu_ms_per_token": cpu,
            "tpot_ms_each": [t * 1e3 for r in rounds for t in r.tpots_s],
        }
        prev = tpot
    out["http_over_engine"] = out["engine"]["tpot_ms"] / out["http"]["tpot_ms"]
    out["http_over_engine_total"] = out["http"]["total_tokens_per_s"] / out["engine"]["total_tokens_per_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a model folder")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=1, help="concurrent requests per round")
    ap.add_argument(
        "--topology",
        choices=("colocated", "compose"),
        default="colocated",
        help="colocated: decode prefills itself; compose: the compose file's mesh (prefill workers, kvstore)",
    )
    ap.add_argument("--compile", action="store_true", help="compiled decode step, in the anchor and in decode")
    ap.add_argument("--json", default="bench/results/hops.json")
    args = ap.parse_args()
    from kvmesh.engine.default_model import default_model_path

    model = default_model_path() if args.model == "default" else Path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(measure(args, model, Path(tmp)))
    procs = list(result["engine"]["cpu_ms_per_token"])
    print(
        f"{args.streams} stream(s) at once, {args.new_tokens} greedy tokens each, "
        f"{args.dtype}{' compiled' if args.compile else ''}, "
        f"{args.topology} mesh, "
        f"median of {args.repeats}; "
        "CPU ms/token per process (the engine depth runs in 'bench')"
    )
    rows = []
    for depth in DEPTHS:
        r = result[depth]
        added = "" if r["added_ms_per_token"] is None else f"{r['added_ms_per_token']:+.2f}"
        rows.append(
            [
                depth,
                f"{r['tpot_ms']:.2f}",
                added,
                f"{r['tokens_per_s']:.1f}",
                f"{r['total_tokens_per_s']:.1f}",
                f"{r['ttft_ms']:.0f}",
                *(f"{r['cpu_ms_per_token'][p]:.2f}" for p in procs),
            ]
        )
    print_table(
        ["depth", "ms/token", "added", "tok/s a stream", "tok/s all", "TTFT ms", *(f"cpu {p}" for p in procs)], rows
    )
    print(
        f"HTTP / in-process engine: {result['http_over_engine']:.2f}x a stream, "
        f"{result['http_over_engine_total']:.2f}x all streams"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "dtype": args.dtype,
        "compile": args.compile,
        "topology": args.topology,
        "new_tokens": args.new_tokens,
        "streams": args.streams,
    }
    Path(args.json).write_text(json.dumps({**meta, **result}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
