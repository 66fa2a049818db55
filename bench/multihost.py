"""A mesh across hosts: what a real link costs (TTFT, throughput) and what a partition costs (the fault matrix).

Hosts are network namespaces on one bridge (``kvmesh.launcher.netns``): every process binds to its host's
address, and KV between hosts crosses a veth link like a NIC (NIXL held to UCX over TCP: no shared-memory
shortcut between "hosts"). This client runs on the bridge itself, like a client on the same network.

``--part perf`` (SmolLM2-135M, the default model; 1 prefill + 1 decode worker, no speculator, decode never
prefills, so every prompt is handed off). Meshes, all up at once, measured in rotating order each round:
- ``colocated``: every process on one host (NIXL on UCX's defaults, shared memory included): the anchor;
- ``split``: every process on a host of its own, each host's link uncapped, then capped by a token bucket at
  25 and 10 Gbit/s (both directions);
each for ``nixl`` and ``grpc`` KV transport. Per mesh and cap: TTFT (gRPC) of a fresh 1k- and 8k-token prompt
(prefill and hand-off time from the final message), and HTTP tokens/s of 16 concurrent streams
(``/v1/completions``, fresh 128-token prompts, 64 tokens each). Medians over ``--rounds``; ratios are
split / colocated of the same transport.

``--part partitions`` (models/pycode-small, 2 prefill + 2 decode workers, speculator beside the kvstore, every
other process alone on a host: compose/hosts.yml; every timeout at its default). bench/faults.py's storm (``--streams``
concurrent greedy streams with known outputs), but instead of a kill a host is cut off the network for
``--cut-s`` seconds in the middle, then healed: the busiest decode host, a prefill host, the kvstore (+
speculator) host, the router's, Redis's, and the link between the gateway and the busiest decode worker;
and through Toxiproxy in front of prefill-0 (its peers reach it through the proxy), for as long: every
connection reset (``prefill-resets``), or 20 ms added each way (``prefill-latency``).
Columns as bench/faults.py, with ``hangs`` = not finished ``--hang-after`` seconds after the cut (shorter
than the cut: a stream that waits for the heal counts), ``serve again s`` = from the heal until every
process serves and every worker is registered again, and ``restarts`` = processes that exited meanwhile.

Run (under the bench lock, as root): ``flock /tmp/kvmesh-bench.lock python bench/multihost.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import faults  # noqa: E402
from _common import write_json  # noqa: E402
from _idle_cpu import wait_for_idle_cpu  # noqa: E402
from _table import print_table  # noqa: E402
from peers import http_round, model_id  # noqa: E402
from ttft_mesh import one as ttft_one  # noqa: E402

from kvmesh.api.gateway.v1 import gateway_pb2_grpc  # noqa: E402
from kvmesh.engine.default_model import default_model_path  # noqa: E402
from kvmesh.launcher import MeshOptions, RestartPolicy, build_topology  # noqa: E402
from kvmesh.launcher.compose import REPO_ROOT  # noqa: E402
from kvmesh.launcher.hosts import HostsFile  # noqa: E402
from kvmesh.launcher.multihost import HostedMesh  # noqa: E402
from kvmesh.runtime.ports import free_port  # noqa: E402

TRANSPORTS = ("nixl", "grpc")
CAPS = {"none": None, "25G": 25e9, "10G": 10e9}
PROMPT_LENGTHS = (1000, 8000)
STREAMS, STREAM_PROMPT, STREAM_TOKENS = 16, 128, 64
# SmolLM2's vocabulary, clear of its special tokens at the bottom.
TOKEN_IDS = (100, 49000)
CASES = ("decode", "prefill", "kvstore", "router", "redis", "gateway-link", "prefill-resets", "prefill-latency")
# The Toxiproxy cases: prefill-0 is behind a proxy on its host; for --cut-s its link resets every connection,
# or adds 20 ms each way: (toxic, direction, attributes).
PROXIED = "prefill-0"
TOXICS = {
    "prefill-resets": [("reset_peer", "downstream", {"timeout": 0})],
    "prefill-latency": [("latency", direction, {"latency": 20}) for direction in ("upstream", "downstream")],
}
# Never prefill on decode: every prompt takes the hand-off, the path under test.
DISAGGREGATED = {"KVMESH_LOCAL_PREFILL_MAX_UNCACHED_TOKENS": "0", "KVMESH_LOCAL_PREFILL_MIN_HIT_FRACTION": "2"}


# -- perf ---------------------------------------------------------------------------------------------------


def perf_options(model: Path, transport: str) -> MeshOptions:
    blocks = (sum(PROMPT_LENGTHS) + STREAMS * (STREAM_PROMPT + STREAM_TOKENS)) // 16 + 64
    worker = {"KVMESH_NUM_BLOCKS": str(blocks), "KVMESH_KV_TRANSPORT": transport}
    env = {
        "router": DISAGGREGATED,
        "prefill": worker,
        "decode": worker,
        "kvstore": {"KVMESH_KV_TRANSPORT": transport},
        "gateway": {"KVMESH_HTTP_PORT": str(free_port())},
    }
    return MeshOptions(
        model=model, prefill=1, decode=1, speculator=False, gateway_port=0, publish=False, role_env=env,
        log_level="warning", grace_seconds=3.0,
    )  # fmt: skip


class NotHandedOff(RuntimeError):
    pass


class PerfMesh:
    """One mesh of the perf part: its placement, transport and the numbers measured on it."""

    def __init__(self, placement: str, transport: str, model: Path, run_dir: Path) -> None:
        self.placement, self.transport = placement, transport
        options = perf_options(model, transport)
        names = [p.name for p in build_topology(options, run_dir).processes]
        hosts = HostsFile.one_host(names) if placement == "colocated" else HostsFile.each_alone(names)
        self.hosted = HostedMesh.plan(options, run_dir, hosts)
        self.caps = ["none"] if placement == "colocated" else list(CAPS)
        self.samples: dict[str, list[dict]] = {cap: [] for cap in self.caps}
        self.failures: dict[str, list[str]] = {cap: [] for cap in self.caps}

    @property
    def name(self) -> str:
        return f"{self.placement}/{self.transport}"

    def cap(self, cap: str) -> None:
        for host in self.hosted.network.hosts:
            self.hosted.network.shape(host, CAPS[cap])

    async def measure(self, cap: str, rng: torch.Generator) -> dict:
        mesh = self.hosted.mesh
        out: dict = {}
        async with grpc.aio.insecure_channel(mesh.address("gateway")) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            for n in PROMPT_LENGTHS:
                wait_for_idle_cpu()
                r = await ttft_one(gateway, fresh(rng, n))
                if not r["prefill_ms"]:  # decode prefilled it: the prefill worker was gone (killed for memory, say)
                    raise NotHandedOff(f"the {n}-token prompt was not handed off: is the prefill worker alive?")
                out |= {f"{k.removesuffix('_ms')}_{n}_ms": v for k, v in r.items()}
        gw = mesh.topology.get("gateway")
        url = f"http://{gw.host}:{gw.env['KVMESH_HTTP_PORT']}"
        wait_for_idle_cpu()
        r = await http_round(url, model_id(url), [fresh(rng, STREAM_PROMPT) for _ in range(STREAMS)], STREAM_TOKENS)
        return out | {"tokens_per_s": r["tokens_per_s"]}


def fresh(rng: torch.Generator, n: int) -> list[int]:
    """A prompt no cache has seen."""
    return torch.randint(*TOKEN_IDS, (n,), generator=rng).tolist()


async def warm_up(m: PerfMesh, rng: torch.Generator) -> None:
    """Connections, NIXL handshakes, first-use allocations: not measured."""
    async with grpc.aio.insecure_channel(m.hosted.mesh.address("gateway")) as channel:
        await ttft_one(gateway_pb2_grpc.GatewayServiceStub(channel), fresh(rng, 256))


def perf(args: argparse.Namespace, tmp: Path) -> dict:
    model = default_model_path()
    meshes = [PerfMesh(p, t, model, tmp / f"{p}-{t}") for t in args.transports for p in ("colocated", "split")]
    rng = torch.Generator().manual_seed(5)
    started: list[PerfMesh] = []
    try:
        for m in meshes:
            started.append(m)
            m.hosted.start()
            asyncio.run(warm_up(m, rng))
        runs = [(m, cap) for m in meshes for cap in m.caps]
        for rnd in range(args.rounds):
            shift = rnd % len(runs)
            for m, cap in runs[shift:] + runs[:shift]:
                m.cap(cap)
                try:
                    sample = asyncio.run(m.measure(cap, rng))
                except (grpc.aio.AioRpcError, NotHandedOff) as e:  # kept, and the run goes on: the logs say why
                    why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
                    m.failures[cap].append(f"round {rnd}: {why}")
                    print(f"round {rnd} {m.name} {cap}: FAILED {m.failures[cap][-1]}", flush=True)
                    continue
                m.samples[cap].append(sample)
                shown = ", ".join(f"{k} {v:.1f}" for k, v in sample.items())
                print(f"round {rnd} {m.name} {cap}: {shown}", flush=True)
    finally:
        for m in started:
            m.hosted.stop()
    rows = []
    for m in meshes:
        for cap in m.caps:
            samples = m.samples[cap]
            med = {k: statistics.median(s[k] for s in samples) for k in (samples[0] if samples else {})}
            row = {"placement": m.placement, "transport": m.transport, "cap": cap, "failures": m.failures[cap]}
            rows.append(row | med | {"samples": m.samples[cap]})
    for r in rows:
        anchor = next(a for a in rows if a["placement"] == "colocated" and a["transport"] == r["transport"])
        for key in [*(f"ttft_{n}_ms" for n in PROMPT_LENGTHS), "tokens_per_s"]:
            value, base = r.get(key), anchor.get(key)
            r[f"{key}_ratio"] = value / base if value is not None and base is not None else None
    return {"rows": rows}


def print_perf(result: dict) -> None:
    headers = ["placement", "transport", "link cap"]
    for n in PROMPT_LENGTHS:
        headers += [f"TTFT {n // 1000}k ms", "x coloc", "hand-off ms"]
    headers += ["tok/s (16)", "x coloc", "failed"]

    def cell(r: dict, key: str, spec: str) -> str:
        return "-" if r.get(key) is None else format(r[key], spec)

    rows = []
    for r in result["rows"]:
        row = [r["placement"], r["transport"], r["cap"]]
        for n in PROMPT_LENGTHS:
            ttft = f"ttft_{n}_ms"
            row += [cell(r, ttft, ".0f"), cell(r, f"{ttft}_ratio", ".2f"), cell(r, f"transfer_{n}_ms", ".0f")]
        row += [cell(r, "tokens_per_s", ".1f"), cell(r, "tokens_per_s_ratio", ".2f"), str(len(r["failures"]))]
        rows.append(row)
    print_table(headers, rows)


# -- partitions ---------------------------------------------------------------------------------------------


class PartitionBench(faults.Bench):
    """bench/faults.py's storm with a partition instead of a kill: the fault is ``strike``."""

    def __init__(self, hosted: HostedMesh, args: argparse.Namespace) -> None:
        super().__init__(hosted.mesh, args)
        self.hosted = hosted
        self.case = ""

    async def round(self, victim: str) -> dict:
        self.case = victim
        before = {p.name: self.mesh.restarts(p.name) for p in self.mesh.topology.processes}
        result = await super().round(victim)
        restarted = [n for n, r in before.items() if self.mesh.restarts(n) != r]
        return result | {"case": victim, "restarts": restarted}

    def victim_process(self, victim: str) -> str | None:
        if victim.startswith("prefill-"):
            return PROXIED
        return super().victim_process("decode" if victim == "gateway-link" else victim)

    def fault(self, name: str) -> tuple[Callable[[], None], Callable[[], None]]:
        """What this round's case does to ``name``'s link, and how it is undone."""
        network, host = self.hosted.network, self.hosted.host_of(name)
        if self.case == "gateway-link":
            gateway = self.hosted.host_of("gateway")
            return lambda: network.cut_between(gateway, host), lambda: network.heal_between(gateway, host)
        if self.case in TOXICS:
            (proxy,) = self.hosted.proxies
            added: list[str] = []

            def inflict() -> None:
                added[:] = [proxy.add_toxic(PROXIED, kind, stream, **a) for kind, stream, a in TOXICS[self.case]]

            def undo() -> None:
                for toxic in added:
                    proxy.remove_toxic(PROXIED, toxic)

            return inflict, undo
        return lambda: network.cut(host), lambda: network.heal(host)

    async def strike(self, name: str) -> float:
        """Cut ``name``'s host (or the case's link) for ``--cut-s``, heal it, and return the seconds from the
        heal until the whole mesh serves again."""
        inflict, undo = self.fault(name)
        inflict()
        await asyncio.sleep(self.args.cut_s)
        undo()
        healed = time.monotonic()
        await self.healthy()
        return time.monotonic() - healed


async def partitions(args: argparse.Namespace, tmp: Path) -> dict:
    env = {
        "router": DISAGGREGATED,
        "prefill": {"KVMESH_NUM_BLOCKS": "512"},
        "decode": {"KVMESH_NUM_BLOCKS": "512", "KVMESH_NUM_SPECULATIVE_TOKENS": "4"},
    }
    options = MeshOptions(
        model=faults.MODEL, prefill=2, decode=2, publish=False, gateway_port=0, grace_seconds=3.0, role_env=env,
        log_level="warning",
    )  # fmt: skip
    hosts = HostsFile.load(REPO_ROOT / "compose" / "hosts.yml")
    policy = RestartPolicy(initial_backoff_s=0.5, max_restarts=20)
    hosted = HostedMesh.plan(options, tmp, hosts, restart=policy, on_progress=lambda m: None)
    hosted.behind_proxy(PROXIED)
    with hosted:
        bench = PartitionBench(hosted, args)
        await bench.healthy()
        await bench.references([args.max_tokens])
        rounds = [await bench.round(case) for case in args.cases]
    return {"rounds": rounds}


def print_partitions(result: dict) -> None:
    headers = ["partition", "host", "completed", "migrated", "retried", "kv lost", "errors", "hangs", "wrong",
               "recovery s", "serve again s", "leaked blocks", "leases", "in flight", "restarts"]  # fmt: skip
    rows = [
        [
            r["case"],
            r["process"],
            r["completed"],
            r["migrated"],
            r["retried"],
            r["kv_lost"],
            r["errors"],
            r["hangs"],
            r["wrong"],
            f"{r['recovery_s']:.1f}",
            f"{r['back_s']:.1f}",
            f"{r['leaks']['kv_blocks']:.0f}",
            f"{r['leaks']['leases']:.0f}",
            f"{r['leaks']['inflight']:.0f}",
            ",".join(r["restarts"]) or "-",
        ]  # fmt: skip
        for r in result["rounds"]
    ]
    print_table(headers, rows)
    for r in result["rounds"]:
        for sample in r["error_samples"]:
            print(f"  {r['case']}: {sample}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("perf", "partitions", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=3, help="perf: measurements per mesh and cap")
    ap.add_argument(
        "--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS,
        help="perf: a colocated and a split mesh each (all up at once: an 8k-token prefill takes ~3.6 GB)",
    )  # fmt: skip
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--streams", type=int, default=16, help="partitions: concurrent streams")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cut-s", type=float, default=30.0, help="how long a host stays cut off")
    ap.add_argument("--hang-after", type=float, default=25.0, help="seconds after the cut a stream counts as hung")
    ap.add_argument("--json", default="bench/results/multihost.json")
    args = ap.parse_args()
    result: dict = {"config": vars(args)}
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-multihost-"))
    print(f"meshes' logs in {tmp}", flush=True)
    if args.part in ("perf", "both"):
        result["perf"] = perf(args, tmp / "perf")
        print_perf(result["perf"])
    if args.part in ("partitions", "both"):
        result["partitions"] = asyncio.run(partitions(args, tmp / "partitions"))
        print_partitions(result["partitions"])
    write_json(args.json, result)
    if "perf" in result:
        print_perf(result["perf"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
