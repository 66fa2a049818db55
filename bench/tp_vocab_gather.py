"""Gather the vocab-parallel LM head's logits, or sample greedy per shard: what each costs between two ranks.

Each rank holds the logits of its half of the vocabulary ([rows, vocab/2], float32). Two ways to a greedy token:

- **gather** (what the engine does, ``CausalLM._gather_vocab``): each rank writes its shard into zeros
  [rows, vocab] and the shared-memory all-reduce adds them up, so every rank holds whole rows. Grammar masks,
  penalties, logit bias, top-k/top-p, seeded sampling and logprobs all need whole rows.
- **per shard** (greedy only): each rank takes its shard's max and argmax, and one all-reduce of
  [rows, 2 x ranks] brings every rank's best to rank 0, which picks the largest (ties to the lower rank: the lower
  token id, as an argmax over the whole row).

Both go through the real ``ShmAllReduce`` between this process (rank 0) and a child (rank 1), each on one
thread; the time is rank 0's, median of ``--iterations`` calls after ``--iterations // 10`` untimed ones, the
two methods alternating. The anchor is the gather.

Run (not part of ``make test``; seconds): ``flock /tmp/kvmesh-bench.lock python bench/tp_vocab_gather.py
[--iterations 300] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402

from kvmesh.engine.shm_all_reduce import ShmAllReduce, create_memory  # noqa: E402

SHAPES = [(1, 8192), (16, 8192), (1, 49152), (16, 49152), (64, 49152)]  # rows x vocab (SmolLM2's: 49,152)
RANKS = 2


def gather(reduce: ShmAllReduce, part: torch.Tensor, rank: int, vocab: int) -> torch.Tensor:
    count = part.shape[1]
    whole = part.new_zeros((part.shape[0], vocab))
    whole[:, rank * count : (rank + 1) * count] = part
    reduce(whole)
    return whole.argmax(dim=-1)


def per_shard(reduce: ShmAllReduce, part: torch.Tensor, rank: int, vocab: int) -> torch.Tensor:
    best, where = part.max(dim=-1)
    out = part.new_zeros((part.shape[0], 2 * RANKS))
    out[:, rank] = best
    out[:, RANKS + rank] = where.float() + rank * part.shape[1]  # exact below 2^24 tokens
    reduce(out)
    winner = out[:, :RANKS].argmax(dim=-1, keepdim=True)
    return out[:, RANKS:].gather(1, winner).squeeze(1).long()


def run(reduce: ShmAllReduce, rank: int, iterations: int) -> dict:
    """Every shape, both methods, on this rank (the ranks run the same calls in the same order)."""
    g = torch.Generator().manual_seed(0)
    results = {}
    for rows, vocab in SHAPES:
        whole = torch.randn(rows, vocab, generator=g)
        count = vocab // RANKS
        part = whole[:, rank * count : (rank + 1) * count].contiguous()
        assert torch.equal(gather(reduce, part, rank, vocab), whole.argmax(dim=-1))
        assert torch.equal(per_shard(reduce, part, rank, vocab), whole.argmax(dim=-1))
        times = {"gather": [], "per_shard": []}
        warm_up = iterations // 10
        for i in range(warm_up + iterations):
            for name, fn in (("gather", gather), ("per_shard", per_shard)):
                t0 = time.perf_counter()
                fn(reduce, part, rank, vocab)
                if i >= warm_up:
                    times[name].append(time.perf_counter() - t0)
        results[f"{rows}x{vocab}"] = {k: statistics.median(v) for k, v in times.items()}
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--json", default="bench/results/tp_vocab_gather.json")
    ap.add_argument("--follower-fd", type=int, help=argparse.SUPPRESS)  # rank 1: the memory file it inherited
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.follower_fd is not None:
        parent = os.getppid()
        reduce = ShmAllReduce(args.follower_fd, 1, RANKS, 60.0)
        reduce.watch(lambda: os.getppid() == parent)  # rank 0 gone: give up at once
        run(reduce, 1, args.iterations)
        return 0
    fd = create_memory(RANKS)
    argv = [sys.executable, __file__, "--follower-fd", str(fd), "--iterations", str(args.iterations)]
    child = subprocess.Popen(argv, pass_fds=[fd])
    reduce = ShmAllReduce(fd, 0, RANKS, 60.0)
    reduce.watch(lambda: child.poll() is None)
    os.close(fd)
    try:
        results = run(reduce, 0, args.iterations)
    except BaseException:
        child.kill()
        raise
    if child.wait(60) != 0:
        raise SystemExit(f"rank 1 failed (exit code {child.returncode})")
    rows = []
    for (r, v), t in zip(SHAPES, results.values()):
        rows.append(
            [
                f"{r} x {v:,}",
                f"{r * v * 4 / 1e6:.2f}",
                f"{1e6 * t['gather']:.0f} us",
                f"{1e6 * t['per_shard']:.0f} us",
                f"{t['gather'] / t['per_shard']:.1f}x",
            ]
        )
    print(f"\n{RANKS} ranks, one thread each, float32 logits, medians of {args.iterations} calls")
    print_table(["rows x vocab", "MB gathered", "gather", "per-shard greedy", "per shard faster by"], rows)
    write_json(args.json, {"ranks": RANKS, "iterations": args.iterations, "seconds": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
