"""Structured outputs: decode speed with a JSON-schema constraint vs without, same run.

On ``models/pycode-small`` (or ``--model``), greedy, at batch 1 (one request at
a time) and batch 16 (sixteen in flight):
  (a) constrained: each request must produce a JSON array of records
      (``RECORDS``), masked token by token by its grammar;
  (b) free (the anchor): the same prompts, each with ``max_tokens`` equal to
      the number of tokens its constrained twin produced and ``ignore_eos``,
      so both runs generate exactly the same token counts in the same batches.
The two run back to back, in alternating order, ``--repeats`` times. Reports
tokens/s of the fastest pass of each and two ratios constrained / free (goal:
>= 0.9): of those fastest passes, and the median of the paired passes' ratios
(steadier on a shared machine); the engine's own time spent on masks per step
and as a share of the run; and checks every constrained output validates.

Also compiles every schema of the test corpus (``tests/structured/schemas.py``)
on a fresh cache: compile time per schema, cold and cached.

Run: ``python bench/structured.py [--model PATH] [--repeats 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import cells, write_json  # noqa: E402
from _table import print_table  # noqa: E402

from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.engine.grammar import GrammarCache  # noqa: E402
from kvmesh.sampling import SamplingParams  # noqa: E402
from kvmesh.structured.spec import GrammarSpec  # noqa: E402
from tests.structured.schemas import SCHEMAS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECORDS = {
    "type": "array",
    "minItems": 6,
    "maxItems": 6,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "kind": {"type": "string", "enum": ["module", "class", "function"]},
            "public": {"type": "boolean"},
        },
        "required": ["id", "name", "kind", "public"],
    },
}
PROMPT_TEXTS = [f"# Index of the package, part {i}\nindex = " for i in range(16)]


def run(engine: LLMEngine, prompts: list[list[int]], batch: int, params: list[SamplingParams]) -> dict:
    tokens: list[list[int]] = []
    texts: list[str] = []
    steps0, rows0, mask0 = engine.stats.steps, engine.stats.grammar_masked_rows, engine.stats.grammar_mask_seconds
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for c in engine.generate(prompts[i : i + batch], params[i : i + batch]):
            tokens.append(c.token_ids)
            texts.append(c.text)
    elapsed = time.perf_counter() - t0
    generated = sum(len(t) for t in tokens)
    return {
        "tokens": tokens, "texts": texts, "seconds": elapsed, "generated_tokens": generated,
        "tokens_per_s": generated / elapsed, "steps": engine.stats.steps - steps0,
        "masked_rows": engine.stats.grammar_masked_rows - rows0,
        "mask_seconds": engine.stats.grammar_mask_seconds - mask0,
    }  # fmt: skip


def compile_times(engine: LLMEngine) -> list[dict]:
    cache = GrammarCache(engine.tokenizer, engine.model_config.vocab_size, sorted(engine.eos_token_ids))
    out = []
    for name, schema in [("records", RECORDS), *SCHEMAS]:
        spec = GrammarSpec.json_schema(schema)
        t0 = time.perf_counter()
        cache.compiled(spec)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache.compiled(spec)
        out.append({"schema": name, "cold_ms": cold * 1e3, "cached_ms": (time.perf_counter() - t0) * 1e3})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "models" / "pycode-small")
    p.add_argument("--repeats", type=int, default=3, help="passes per configuration, interleaved; the fastest counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "structured.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    engine = LLMEngine(args.model, EngineConfig(num_blocks=1024))
    prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in PROMPT_TEXTS]
    spec = GrammarSpec.json_schema(RECORDS)
    constrained = [SamplingParams(temperature=0.0, max_tokens=400, grammar=spec) for _ in prompts]
    # The free runs' lengths: each request exactly as long as its constrained twin.
    lengths = [len(c.token_ids) for c in engine.generate(prompts, constrained)]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    best: dict[tuple[int, str], dict] = {}
    ratios: dict[int, list[float]] = {1: [], 16: []}
    for rep in range(args.repeats):
        for batch in (1, 16):
            # Paired passes, back to back, in alternating order: load from other processes hits both alike.
            order = [("constrained", constrained), ("free", free)][:: 1 if rep % 2 == 0 else -1]
            r = {mode: run(engine, prompts, batch, params) for mode, params in order}
            assert [len(t) for t in r["constrained"]["tokens"]] == lengths
            ratios[batch].append(r["constrained"]["tokens_per_s"] / r["free"]["tokens_per_s"])
            for mode in r:
                if (batch, mode) not in best or r[mode]["seconds"] < best[batch, mode]["seconds"]:
                    best[batch, mode] = r[mode]
            print(
                f"pass {rep + 1}: batch {batch}: constrained {r['constrained']['tokens_per_s']:.1f} tok/s, "
                f"free {r['free']['tokens_per_s']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )

    results, rows = [], []
    for batch in (1, 16):
        c, f = best[batch, "constrained"], best[batch, "free"]
        for text in c["texts"]:
            jsonschema.validate(json.loads(text), RECORDS)
        ratio = c["tokens_per_s"] / f["tokens_per_s"]
        paired = statistics.median(ratios[batch])
        mask_share = c["mask_seconds"] / c["seconds"]
        results.append(
            {
                "batch": batch,
                "constrained": _summary(c),
                "free": _summary(f),
                "ratio_fastest": ratio,
                "ratio_paired_median": paired,
                "paired_ratios": ratios[batch],
                "mask_share": mask_share,
                "all_valid": True,
            }
        )
        rows.append(
            cells(
                [
                    batch,
                    f["generated_tokens"],
                    f["tokens_per_s"],
                    c["tokens_per_s"],
                    ratio,
                    paired,
                    c["mask_seconds"] * 1e6 / c["steps"],
                    mask_share,
                    "yes",
                ]
            )
        )
    print_table(
        [
            "batch",
            "tokens",
            "free tok/s",
            "constrained tok/s",
            "ratio (fastest)",
            "ratio (paired median)",
            "mask us/step",
            "mask share",
            "all valid",
        ],
        rows,
    )

    compiles = compile_times(engine)
    print()
    print_table(
        ["schema", "compile ms (cold)", "cached ms"],
        [cells([c["schema"], c["cold_ms"], c["cached_ms"]]) for c in compiles],
    )
    cold = [c["cold_ms"] for c in compiles]
    print(
        f"\ncompile per schema: mean {statistics.mean(cold):.1f} ms, max {max(cold):.1f} ms "
        f"({len(cold)} schemas, vocabulary {engine.model_config.vocab_size})"
    )
    write_json(args.json, {
        "model": str(args.model), "vocab_size": engine.model_config.vocab_size, "runs": results,
        "compile": compiles, "compile_mean_ms": statistics.mean(cold), "compile_max_ms": max(cold),
        "goal_ratio": 0.9,
    })  # fmt: skip


def _summary(r: dict) -> dict:
    return {k: r[k] for k in ("seconds", "generated_tokens", "tokens_per_s", "steps", "masked_rows", "mask_seconds")}


if __name__ == "__main__":
    main()
