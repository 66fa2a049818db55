"""What placing the EAGLE head in the speculator service (placement b) would cost per step.

The head needs the target's feature of each sequence's last verified position,
every step: in the service, a step's drafts wait for one round trip on the
existing Propose stream (decode -> service -> decode) carrying one feature per
sequence. This measures, in the same run:
  - the stream's round trip today (``SpeculatorProposer.propose`` against a
    speculator service started as its own process on 127.0.0.1), with the
    contexts growing a token a step, at batch 1 and 8;
  - the head's drafting time for k tokens in-process (placement a);
  - the target's decode step (the anchor both are compared to).
The feature payload (hidden x 2 bytes in fp16 per sequence) is reported, not sent:
the round trip here is a floor for (b), which would also carry it.

Run: ``flock /tmp/kvmesh-bench.lock python bench/speculation_hop.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import cells, write_json  # noqa: E402
from _table import print_table  # noqa: E402

from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.default_model import default_model_path  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.engine.sequence import Sequence, Status  # noqa: E402
from kvmesh.sampling import SamplingParams  # noqa: E402
from kvmesh.speculation.drafter import Drafter
from kvmesh.speculation.eagle import EagleProposer  # noqa: E402
from services.speculator.client import SpeculatorProposer  # noqa: E402
from tests.service_helpers import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


async def stream_round_trips(batch: int, steps: int, k: int) -> list[float]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.speculator.main",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--log-level",
            "warning",
        ]
    )
    proposer = SpeculatorProposer(f"127.0.0.1:{port}", budget_ms=1000.0, registry=CollectorRegistry())
    try:
        await proposer.start()
        async with asyncio.timeout(30):
            while not proposer.connected:
                await asyncio.sleep(0.01)
        seqs = []
        for i in range(batch):
            s = Sequence(
                f"r{i}", [100 + i + j % 50 for j in range(64)], SamplingParams(temperature=0.0, max_tokens=10_000)
            )
            s.status = Status.RUNNING
            seqs.append(s)
        times = []
        for step in range(steps):
            for s in seqs:
                s.output_ids.append(7 + step % 13)
            t0 = time.perf_counter()
            await asyncio.to_thread(proposer.propose, [(s, k) for s in seqs])
            times.append(time.perf_counter() - t0)
        return times[5:]  # the first steps send whole contexts
    finally:
        await proposer.close()
        proc.terminate()
        proc.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", type=Path, default=REPO / "models" / "smollm2-eagle")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "speculation_hop.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = default_model_path()
    rows, results = [], []
    for batch in (1, 8):
        proposer = EagleProposer(args.head)
        engine = LLMEngine(model, EngineConfig(num_blocks=256), drafter=Drafter(None, 0))
        proposer.bind(engine.model)
        for i in range(batch):
            engine.add_request(
                [1 + i, 2, 3, 4, 5, 6, 7, 8],
                SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True),
            )
        step_times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t0)
        # A layered head (EAGLE-3 style) drafts from several layers' outputs, concatenated.
        feature_size = engine.model_config.hidden_size * max(1, len(proposer.feature_layers))
        features = torch.randn(batch, feature_size)
        tokens = torch.arange(batch)
        draft_times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            proposer.head.draft(features, tokens, args.k)
            draft_times.append(time.perf_counter() - t0)
        rtts = asyncio.run(stream_round_trips(batch, args.steps, args.k))
        r = {
            "batch": batch,
            "target_step_ms": statistics.median(step_times[2:]) * 1e3,
            "head_draft_ms": statistics.median(draft_times) * 1e3,
            "stream_round_trip_ms": statistics.median(rtts) * 1e3,
            "feature_bytes_per_step": batch * feature_size * 2,
        }
        results.append(r)
        rows.append(
            cells(
                [batch, r["target_step_ms"], r["head_draft_ms"], r["stream_round_trip_ms"], r["feature_bytes_per_step"]]
            )
        )
    print_table(
        ["batch", "target step ms", f"head k={args.k} ms (a)", "stream round trip ms (b floor)", "feature bytes/step"],
        rows,
    )
    write_json(args.json, {"model": str(model), "k": args.k, "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()
