"""The fault matrix: kill one service under concurrent streams, and count what the clients saw.

One supervised mesh (real processes, real Redis; ``--decode`` and ``--prefill``
workers, speculation on) serves every round. Per victim (decode, prefill,
kvstore, speculator, router, redis, gateway) one storm: ``--streams``
concurrent greedy streams, the victim SIGKILLed while they stream (prefill:
while prompts are still being prefilled), the supervisor restarting it. The
anchor is the ``none`` round in the same run: the same storm with no kill.

Per round:
- completed: streams that ended normally with exactly the tokens the same
  prompt gave before any fault (greedy); ``migrated``: streams the gateway
  moved to another decode worker mid-stream, ``retried``: requests it routed
  again after a worker failed before their first token (its counters),
  ``kv lost``: KV hand-offs whose pull failed, so decode computed the prompt
  itself (the decode workers' transfer failures);
- errors: streams that ended with a gRPC status (a clear error);
- hangs: streams not finished ``--hang-after`` seconds after the kill;
- wrong: streams that ended "normally" with other tokens than the reference
  (fewer, or different) -- silently wrong;
- recovery s: from the kill to the end of the last failed probe (a short
  request sent every 0.25 s from the kill on, each on a fresh connection);
  0 when none failed;
- back s: from the kill until the victim serves again (restarted);
- leaks, once the storm is over and the victim is back: KV blocks in use on
  every worker, prefill leases, requests in flight (gateway and decode).

``--soak MINUTES``: instead of the matrix, mixed traffic (``--streams``
concurrent streams of random prompts and lengths) with a random victim killed
every 10-20 s; the same totals.

Run (under the bench lock): ``flock /tmp/kvmesh-bench.lock python bench/faults.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _table import print_table  # noqa: E402

from kvmesh.api.common.v1 import sampling_pb2  # noqa: E402
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from kvmesh.launcher import Mesh, MeshOptions, RestartPolicy, build_topology  # noqa: E402
from kvmesh.launcher.compose import REPO_ROOT  # noqa: E402
from kvmesh.launcher.scrape import scrape  # noqa: E402
from kvmesh.runtime import create_channel

MODEL = REPO_ROOT / "models" / "pycode-small"
PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef walk(path):",
    "def parse_args(argv):\n    parser = ",
    "for i in range(10):\n    ",
    "with open(path) as f:\n    ",
    "def __repr__(self):\n    return ",
    "try:\n    import json\nexcept ImportError:\n    ",
]
COUNTS = ("completed", "migrated", "retried", "kv_lost", "errors", "hangs", "wrong")
VICTIMS = ("none", "decode", "prefill", "kvstore", "speculator", "router", "redis", "gateway")


@dataclass
class Tally:
    completed: int = 0
    migrated: int = 0
    retried: int = 0
    kv_lost: int = 0
    errors: int = 0
    hangs: int = 0
    wrong: int = 0
    error_samples: list[str] = field(default_factory=list)


def metrics(mesh: Mesh, name: str) -> dict[str, float]:
    try:
        return scrape(mesh.topology.get(name), timeout_s=5)
    except OSError:
        return {}


def request(prompt: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        text=prompt, sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )


async def generate(address: str, prompt: str, max_tokens: int, progress: list[int] | None = None) -> list[int]:
    """The stream's tokens; raises grpc.aio.AioRpcError. ``progress`` counts tokens as they come."""
    async with grpc.aio.insecure_channel(address) as channel:
        tokens: list[int] = []
        async for msg in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request(prompt, max_tokens)):
            tokens += msg.token_ids
            if progress is not None:
                progress.append(len(msg.token_ids))
        return tokens


class Bench:
    def __init__(self, mesh: Mesh, args: argparse.Namespace) -> None:
        self.mesh = mesh
        self.args = args
        self.gateway = mesh.address("gateway")
        self.reference: dict[tuple[str, int], list[int]] = {}
        self.workers = [p.name for p in mesh.topology.processes if p.role in ("prefill", "decode")]

    # -- health ----------------------------------------------------------------

    async def serving(self, name: str) -> bool:
        spec = self.mesh.topology.get(name)
        if spec.health == "redis":
            try:
                _, writer = await asyncio.open_connection(spec.host, spec.port)
                writer.close()
                return True
            except OSError:
                return False
        try:
            async with create_channel(spec.address, spec.health_identity) as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False

    async def registered(self) -> set[str]:
        try:
            async with create_channel(self.mesh.address("router"), self.mesh.identity("operator")) as ch:
                resp = await router_pb2_grpc.RouterServiceStub(ch).ListWorkers(
                    router_pb2.ListWorkersRequest(), timeout=2
                )
            return {w.endpoint.worker_id for w in resp.workers}
        except grpc.aio.AioRpcError:
            return set()

    async def healthy(self, timeout_s: float = 120.0) -> None:
        """Every process serves and every worker is registered with the router."""
        wanted = {*self.workers, "kvstore"}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            names = [p.name for p in self.mesh.topology.processes]
            if all(await asyncio.gather(*(self.serving(n) for n in names))) and wanted <= await self.registered():
                return
            await asyncio.sleep(0.2)
        raise RuntimeError("the mesh did not become healthy again")

    async def leaks(self) -> dict[str, float]:
        """What survivors still hold once everything settled (polls up to 20 s for it to drain)."""
        deadline = time.monotonic() + 20
        while True:
            m = {w: await asyncio.to_thread(metrics, self.mesh, w) for w in [*self.workers, "gateway"]}
            found = {
                "kv_blocks": sum(m[w].get("kvmesh_engine_kv_blocks_in_use", 0) for w in self.workers),
                "leases": sum(m[w].get("kvmesh_prefill_active_leases", 0) for w in self.workers),
                "inflight": m["gateway"].get("kvmesh_gateway_inflight_requests", 0)
                + sum(m[w].get("kvmesh_decode_active_requests", 0) for w in self.workers),
            }
            if not any(found.values()) or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.5)

    # -- traffic ---------------------------------------------------------------

    async def references(self, lengths: list[int]) -> None:
        for prompt in PROMPTS:
            for n in lengths:
                self.reference[(prompt, n)] = await generate(self.gateway, prompt, n)

    async def stream(self, prompt: str, n: int, progress: list[int], tally: Tally, hang_at: list[float]) -> None:
        task = asyncio.ensure_future(generate(self.gateway, prompt, n, progress))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if hang_at and time.monotonic() > hang_at[0] and not task.done():
                    task.cancel()
                    tally.hangs += 1
                    return
            tokens = task.result()
        except grpc.aio.AioRpcError as e:
            tally.errors += 1
            if len(tally.error_samples) < 5:
                tally.error_samples.append(f"{e.code().name}: {e.details()}")
            return
        except asyncio.CancelledError:
            task.cancel()
            raise
        if tokens == self.reference[(prompt, n)]:
            tally.completed += 1
        else:
            tally.wrong += 1

    async def probes(self, kill_t: float, stop: asyncio.Event) -> float:
        """Seconds from the kill to the end of the last failed probe (0.0: none failed)."""
        last_failure = None
        while not stop.is_set():
            try:
                await asyncio.wait_for(generate(self.gateway, PROMPTS[0], 4), timeout=10)
            except (grpc.aio.AioRpcError, TimeoutError):
                last_failure = time.monotonic()
            await asyncio.sleep(0.25)
        return 0.0 if last_failure is None else last_failure - kill_t

    async def strike(self, name: str) -> float:
        """The fault: SIGKILL ``name``; returns the seconds until it serves again (restarted)."""
        restarts, kill_t = self.mesh.restarts(name), time.monotonic()
        self.mesh.crash(name)
        while self.mesh.restarts(name) == restarts or not await self.serving(name):
            await asyncio.sleep(0.1)
        return time.monotonic() - kill_t

    def victim_process(self, victim: str) -> str | None:
        if victim == "none":
            return None
        if victim == "decode":
            busy = {
                w: metrics(self.mesh, w).get("kvmesh_engine_kv_blocks_in_use", 0)
                for w in self.workers
                if w.startswith(victim)
            }
            return max(busy, key=busy.get)
        return victim

    async def busy_prefill_worker(self, jobs: list[asyncio.Future]) -> str:
        """The first prefill worker seen computing or holding KV for a hand-off."""
        prefill = [w for w in self.workers if w.startswith("prefill")]
        while not all(j.done() for j in jobs):
            for w in prefill:
                m = await asyncio.to_thread(metrics, self.mesh, w)
                if m.get("kvmesh_engine_kv_blocks_in_use", 0) or m.get("kvmesh_prefill_active_leases", 0):
                    return w
        return prefill[0]  # everything was over before a prefill was seen: kill one anyway

    def counts(self) -> tuple[float, float, float]:
        """The gateway's migrations and retries so far, and the decode workers' failed KV pulls."""
        m = metrics(self.mesh, "gateway")
        retries = sum(v for k, v in m.items() if k.startswith("kvmesh_gateway_retries_total"))
        lost = sum(
            metrics(self.mesh, w).get("kvmesh_decode_transfer_failures_total", 0.0)
            for w in self.workers
            if w.startswith("decode")
        )
        return m.get("kvmesh_gateway_migrations_total{outcome=resumed}", 0.0), retries, lost

    def count_moves(self, tally: Tally, before: tuple[float, float, float]) -> None:
        after = self.counts()
        # max: a restarted worker counts from zero again
        tally.migrated, tally.retried, tally.kv_lost = (max(0, int(a - b)) for a, b in zip(after, before))

    async def round(self, victim: str) -> dict:
        await self.healthy()
        args, tally = self.args, Tally()
        progress: list[list[int]] = [[] for _ in range(args.streams)]
        hang_at: list[float] = []
        moves_before = self.counts()
        jobs = [
            asyncio.ensure_future(self.stream(PROMPTS[i % len(PROMPTS)], args.max_tokens, progress[i], tally, hang_at))
            for i in range(args.streams)
        ]
        if victim == "prefill":  # kill it while it prefills or holds KV not yet handed off
            name = await self.busy_prefill_worker(jobs)
        else:  # the rest: while the streams are mid-way
            while sum(1 for p in progress if p) < args.streams // 2 and not all(j.done() for j in jobs):
                await asyncio.sleep(0.01)
            name = await asyncio.to_thread(self.victim_process, victim)
        kill_t = time.monotonic()
        back = asyncio.ensure_future(self.strike(name)) if name else None
        hang_at.append(kill_t + args.hang_after)
        stop = asyncio.Event()
        probes = asyncio.ensure_future(self.probes(kill_t, stop))
        await asyncio.gather(*jobs)
        back_s = 0.0 if back is None else await back
        await self.healthy()
        await asyncio.sleep(1.0)  # a few probes against the healed mesh
        stop.set()
        recovery_s = await probes
        if victim != "gateway":  # a restarted gateway counts from zero
            self.count_moves(tally, moves_before)
        return {
            "victim": victim,
            "process": name,
            **asdict(tally),
            "recovery_s": recovery_s,
            "back_s": back_s,
            "leaks": await self.leaks(),
        }

    async def soak(self, minutes: float) -> dict:
        args, tally, kills = self.args, Tally(), []
        rng = random.Random(0)
        end = time.monotonic() + minutes * 60
        moves_before = self.counts()

        async def client() -> None:
            while time.monotonic() < end:
                prompt, n = rng.choice(PROMPTS), rng.choice(args.soak_lengths)
                # Hung: not finished --hang-after seconds past a generous time for its length.
                await self.stream(prompt, n, [], tally, [time.monotonic() + args.hang_after + n / 4])

        async def killer() -> None:
            victims = [*self.workers, "kvstore", "speculator", "router", "redis"]
            while time.monotonic() < end - 20:
                await asyncio.sleep(rng.uniform(10, 20))
                name = rng.choice(victims)
                kills.append(name)
                self.mesh.crash(name)

        await asyncio.gather(killer(), *(client() for _ in range(args.streams)))
        await self.healthy()
        self.count_moves(tally, moves_before)
        return {"minutes": minutes, "kills": kills, **asdict(tally), "leaks": await self.leaks()}


async def run(args: argparse.Namespace, run_dir: Path) -> dict:
    env = {
        # Never prefill on decode (unless the router says no prefill worker is left), so prefill matters.
        "router": {
            "KVMESH_LOCAL_PREFILL_MAX_UNCACHED_TOKENS": "0",
            "KVMESH_LOCAL_PREFILL_MIN_HIT_FRACTION": "2",
            "KVMESH_LEASE_TTL_MS": "3000",
        },
        "prefill": {"KVMESH_NUM_BLOCKS": "512"},
        "decode": {"KVMESH_NUM_BLOCKS": "512", "KVMESH_NUM_SPECULATIVE_TOKENS": "4"},
        "gateway": {
            "KVMESH_STREAM_IDLE_TIMEOUT_SECONDS": "10",
            "KVMESH_TOKEN_STALL_TIMEOUT_SECONDS": "5",
            "KVMESH_RPC_TIMEOUT_SECONDS": "2",
            "KVMESH_PREFILL_TIMEOUT_SECONDS": "10",
        },
    }
    options = MeshOptions(
        model=MODEL,
        prefill=args.prefill,
        decode=args.decode,
        publish=False,
        gateway_port=0,
        grace_seconds=3.0,
        role_env=env,
    )
    policy = RestartPolicy(initial_backoff_s=0.5, max_restarts=20)
    mesh = Mesh(build_topology(options, run_dir), run_dir, restart=policy, on_progress=lambda m: None)
    mesh.start()
    try:
        bench = Bench(mesh, args)
        await bench.healthy()
        lengths = args.soak_lengths if args.soak else [args.max_tokens]
        await bench.references(lengths)
        if args.soak:
            return {"soak": await bench.soak(args.soak), "config": vars(args)}
        rounds = [await bench.round(v) for v in args.victims]
        return {"rounds": rounds, "config": vars(args)}
    finally:
        mesh.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", type=int, default=2, help="decode workers")
    ap.add_argument("--prefill", type=int, default=2, help="prefill workers")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--victims", nargs="+", default=list(VICTIMS), choices=VICTIMS)
    ap.add_argument("--hang-after", type=float, default=60.0, help="seconds after the kill a stream counts as hung")
    ap.add_argument("--soak", type=float, metavar="MINUTES", help="soak mode: random kills under mixed traffic")
    ap.add_argument("--soak-lengths", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--json", default="bench/results/faults.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-faults-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))

    headers = [
        "victim",
        "completed",
        "migrated",
        "retried",
        "kv lost",
        "errors",
        "hangs",
        "wrong",
        "recovery s",
        "back s",
        "leaked blocks",
        "leases",
        "in flight",
    ]
    if args.soak:
        s = result["soak"]
        print(f"soak: {s['minutes']:g} min, {args.streams} streams, {len(s['kills'])} kills: {', '.join(s['kills'])}")
        rows = [["(all)", *(s[k] for k in COUNTS), "", "", *s["leaks"].values()]]
        samples = s["error_samples"]
    else:
        print(
            f"fault matrix: {args.decode} decode + {args.prefill} prefill workers, {args.streams} concurrent "
            f"greedy streams of {args.max_tokens} tokens; the victim SIGKILLed mid-stream and restarted"
        )
        rows = [
            [
                r["victim"] + (f" ({r['process']})" if r["process"] and r["process"] != r["victim"] else ""),
                *(r[k] for k in COUNTS),
                f"{r['recovery_s']:.1f}",
                f"{r['back_s']:.1f}",
                *r["leaks"].values(),
            ]
            for r in result["rounds"]
        ]
        samples = [f"{r['victim']}: {e}" for r in result["rounds"] for e in r["error_samples"][:2]]
    print_table(headers, [[f"{c:g}" if isinstance(c, float) else str(c) for c in row] for row in rows])
    if samples:
        print("errors seen (first few):")
        for e in samples:
            print(f"  {e}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
