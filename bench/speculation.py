"""Speculative decoding on the real default model, per draft source, same run.

Greedy decoding of held-out prompts on the installed default model
(SmolLM2-135M-Instruct) in three kinds — ``code`` (raw code completion),
``chat`` (chat-templated questions about Python) and ``prose``
(chat-templated questions with nothing to copy) — at batch 1 (one request at
a time; the first ``--batch1-prompts`` of a kind) and batch 8 (a kind's eight
prompts in flight), k = 2 and 4 (at most: the engine asks a sequence whose
drafts miss for fewer, ``kvmesh.speculation.draft_length``; ``--draft-costs free``
always asks for k), with
drafts from:
  none   — no speculation, the anchor;
  ngram  — prompt lookup in the request's own context (the speculator core in-process);
  suffix — the shared suffix index alone (it learns each pass's finished requests);
  eagle  — the EAGLE head (``--head``, default models/smollm2-eagle) beside the target;
  merged — all three under the core's per-step rule (``kvmesh.speculation.local``).
None of the prompts is in the head's training data (``kvmesh/training/eagle.py``).

Reports per (source, k, batch, kind): mean accepted length (tokens a sequence
gains per target step it takes part in, the bonus token included; and per decode
step, leaving out each request's prefill step, whose one token no draft can
lengthen: at 32 new tokens that step alone costs a 2.5-token source 0.1), acceptance
rate (accepted / proposed drafts), tokens/s and the speed-up over ``none`` at
the same batch; checks every source's tokens equal ``none``'s. Each
configuration runs ``--repeats`` times, interleaved, its fastest pass counts.

Run: ``flock /tmp/kvmesh-bench.lock python bench/speculation.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import cells, write_json  # noqa: E402
from _table import print_table  # noqa: E402

from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.default_model import default_model_path  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.sampling import SamplingParams  # noqa: E402
from kvmesh.speculation.candidate import Source  # noqa: E402
from kvmesh.speculation.draft_length import parse_draft_costs  # noqa: E402
from kvmesh.speculation.drafter import Drafter, DraftProposer  # noqa: E402
from kvmesh.speculation.eagle import EagleProposer  # noqa: E402
from kvmesh.speculation.local import EAGLE_MATCH_TOKENS, LocalProposer  # noqa: E402
from kvmesh.speculation.speculator import SpeculatorConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CODE = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_config(path):\n    with open(path) as f:\n",
    "    def __repr__(self):\n        return",
    "def is_prime(n):\n    if n < 2:\n        return False\n",
    "class TestParser(unittest.TestCase):\n\n    def test_empty(self):\n",
    "def parse_args():\n    parser = argparse.ArgumentParser()\n",
]
CHAT = [
    "How do I check if a key exists in a dictionary?",
    "What is the difference between append and extend?",
    "How do I iterate over the items of a dictionary?",
    "Write a function that returns the largest number in a list.",
    "How do I write text to a file in Python?",
    "What is a lambda function in Python?",
    "How do I get the current date and time in Python?",
    "Explain the difference between a set and a list.",
]
PROSE = [
    "Describe a sunset over the mountains.",
    "Write a short letter to a friend about your holiday.",
    "What makes a good teacher?",
    "Tell me about the history of bread.",
    "Why do cats purr?",
    "Describe your ideal weekend.",
    "Why is friendship important?",
    "Write a paragraph about autumn leaves.",
]
SOURCES = ["none", "ngram", "suffix", "eagle", "merged"]


def prompts_of(model: Path) -> dict[str, list[list[int]]]:
    tok = LLMEngine(model, EngineConfig(num_blocks=16)).tokenizer

    def chat(q: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)

    return {
        "code": [tok.encode(t, add_special_tokens=False) for t in CODE],
        "chat": [chat(q) for q in CHAT],
        "prose": [chat(q) for q in PROSE],
    }


def run(
    model: Path,
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    k: int,
    proposer: DraftProposer | None,
    draft_costs: tuple[float, ...] | None,
    dtype: str,
) -> dict:
    """One timed pass over the prompts, ``batch`` at a time, on a fresh engine and proposer."""
    engine = LLMEngine(
        model,
        EngineConfig(dtype=dtype, num_blocks=512),
        drafter=Drafter(proposer, k, draft_costs) if proposer else None,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens: dict[str, list[int]] = {}
    seq_steps = 0
    t0 = time.perf_counter()
    order = []
    for i in range(0, len(prompts), batch):
        order += [engine.add_request(p, params) for p in prompts[i : i + batch]]
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids:
                    seq_steps += 1
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    elapsed = time.perf_counter() - t0
    stats = engine.stats
    generated = sum(len(t) for t in tokens.values())
    return {
        "tokens": [tokens[r] for r in order],
        "seconds": elapsed,
        "generated_tokens": generated,
        "target_forward_passes": stats.steps,
        "sequence_steps": seq_steps,
        "requests": len(order),
        "proposed": stats.draft_tokens_proposed,
        "accepted": stats.draft_tokens_accepted,
        # What the engine priced a verify of 1, 2, ... drafts at, per batch size (measured at
        # start-up unless --draft-costs says); [] = always k.
        "draft_costs": {str(b): list(c) for b, c in (engine.drafter.costs if engine.drafter else {1: ()}).items()},
    }


def summary(r: dict) -> dict:
    return {
        "tokens_per_s": r["generated_tokens"] / r["seconds"],
        "mean_accepted_length": r["generated_tokens"] / r["sequence_steps"],
        # Each request's first token comes from its prefill step; every later step is a decode or verify.
        "decode_accepted_length": (r["generated_tokens"] - r["requests"]) / max(r["sequence_steps"] - r["requests"], 1),
        "acceptance_rate": r["accepted"] / r["proposed"] if r["proposed"] else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="target model folder (default: the installed default)")
    p.add_argument("--head", type=Path, default=REPO / "models" / "smollm2-eagle")
    p.add_argument("--ks", default="2,4")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--kinds", default="code,chat,prose")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch1-prompts", type=int, default=4, help="prompts per kind at batch 1 (batch 8: all eight)")
    p.add_argument("--eagle-match-tokens", type=int, default=EAGLE_MATCH_TOKENS)
    p.add_argument(
        "--draft-costs",
        default=None,
        help="the Drafter's costs, e.g. 1.2,1.3 (default: measured by each engine; 'free': always k drafts)",
    )
    p.add_argument("--repeats", type=int, default=1, help="passes per configuration, interleaved; the fastest counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the target's (every engine's)")
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "speculation.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    ks = [int(x) for x in args.ks.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    kinds = args.kinds.split(",")
    all_prompts = prompts_of(model)
    draft_costs = parse_draft_costs(args.draft_costs)

    def only(*sources: Source) -> Callable[[], DraftProposer]:
        return lambda: LocalProposer(SpeculatorConfig(ngram_sources=frozenset(sources)))

    makers: dict[str, Callable[[], DraftProposer | None]] = {
        "none": lambda: None,
        "ngram": only(Source.PROMPT),
        "suffix": only(Source.SUFFIX),
        "eagle": lambda: EagleProposer(args.head),
        "merged": lambda: LocalProposer(
            SpeculatorConfig(draft_model_match_tokens=args.eagle_match_tokens), head=EagleProposer(args.head)
        ),
    }
    configs = [
        (kind, batch, src, k)
        for kind in kinds
        for batch in batches
        for src in SOURCES
        for k in ([0] if src == "none" else ks)
    ]
    best: dict[tuple, dict] = {}
    for rep in range(args.repeats):
        for cfg in configs:
            kind, batch, src, k = cfg
            prompts = all_prompts[kind][: args.batch1_prompts] if batch == 1 else all_prompts[kind]
            r = run(model, prompts, batch, args.max_tokens, k, makers[src](), draft_costs, args.dtype)
            if cfg not in best or r["seconds"] < best[cfg]["seconds"]:
                best[cfg] = r
            s = summary(r)
            print(
                f"pass {rep + 1}: {kind} batch {batch} {src} k={k}: {s['tokens_per_s']:.1f} tok/s, "
                f"{s['mean_accepted_length']:.2f} tok/step",
                file=sys.stderr,
                flush=True,
            )

    # "all": the kinds pooled (tokens, steps and seconds summed).
    def pooled(batch: int, src: str, k: int) -> dict:
        rs = [best[kind, batch, src, k] for kind in kinds]
        return {
            key: sum(r[key] for r in rs)
            for key in (
                "seconds",
                "generated_tokens",
                "sequence_steps",
                "requests",
                "proposed",
                "accepted",
                "target_forward_passes",
            )
        }

    results: dict[str, list[dict]] = {src: [] for src in SOURCES}
    rows = []
    identical = True
    for kind in [*kinds, "all"]:
        for batch in batches:
            anchor = summary(best[kind, batch, "none", 0] if kind != "all" else pooled(batch, "none", 0))
            for src in SOURCES:
                for k in [0] if src == "none" else ks:
                    r = best[kind, batch, src, k] if kind != "all" else pooled(batch, src, k)
                    same = kind == "all" or r["tokens"] == best[kind, batch, "none", 0]["tokens"]
                    identical &= same
                    s = summary(r) | {"speedup": summary(r)["tokens_per_s"] / anchor["tokens_per_s"]}
                    entry = {
                        "kind": kind,
                        "batch": batch,
                        "k": k,
                        **s,
                        "target_forward_passes": r["target_forward_passes"],
                        "proposed": r["proposed"],
                        "accepted": r["accepted"],
                        "identical_to_none": same,
                        **({} if kind == "all" else {"draft_costs": r["draft_costs"]}),
                    }
                    results[src].append(entry)
                    rows.append(
                        cells(
                            [
                                kind,
                                batch,
                                src,
                                k or "-",
                                s["mean_accepted_length"],
                                s["decode_accepted_length"],
                                "-" if s["acceptance_rate"] is None else s["acceptance_rate"],
                                s["tokens_per_s"],
                                s["speedup"],
                                r["target_forward_passes"],
                                same,
                            ]
                        )
                    )
    print_table(
        [
            "kind",
            "batch",
            "source",
            "k",
            "tok/step",
            "tok/decode step",
            "acceptance",
            "tok/s",
            "speedup",
            "target passes",
            "same output",
        ],
        rows,
    )
    write_json(
        args.json,
        {
            "model": str(model),
            "head": str(args.head.relative_to(REPO) if args.head.is_relative_to(REPO) else args.head),
            "ks": ks,
            "batches": batches,
            "kinds": kinds,
            "max_tokens": args.max_tokens,
            "batch1_prompts": args.batch1_prompts,
            "eagle_match_tokens": args.eagle_match_tokens,
            "repeats": args.repeats,
            "threads": args.threads,
            "dtype": args.dtype,
            **results,
        },
    )
    if not identical:
        sys.exit("speculation changed the greedy output")


if __name__ == "__main__":
    main()
