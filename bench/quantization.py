"""Quantization fidelity of the default model: every format uniformly, the searched plan at two
budgets, beside the bf16-vs-fp32 noise floor, and whether errors cancelled in the search.

    flock /tmp/kvmesh-bench.lock python bench/quantization.py --json bench/results/quantization.json

The anchor is the unquantized model in fp32 (the reference every row's KL is measured against);
the noise floor (the same weights computed in bf16) is what "indistinguishable" means. The JSON
is rewritten after every row, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.engine.default_model import default_model_path  # noqa: E402
from kvmesh.quant import fidelity  # noqa: E402
from kvmesh.quant.pipeline import DEFAULT_CACHE, FidelitySession, one_thread, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--eval-tokens", type=int, default=20000)
    ap.add_argument(
        "--uniform",
        default="fp8-channel,nvfp4,int8-channel,fp8-tensor",
        help="formats to report applied to every projection ('' for none)",
    )
    ap.add_argument("--budgets", default="6.0,5.0", help="average bits per projection weight")
    ap.add_argument("--search-formats", default="fp8-channel,nvfp4")
    ap.add_argument("--layers-per-group", type=int, default=5)
    ap.add_argument("--search-chunks", type=int, default=6)
    ap.add_argument("--max-trials", type=int, default=4)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--json", type=Path, default=Path("bench/results/quantization.json"))
    args = ap.parse_args()

    with one_thread():
        run(args)


def run(args: argparse.Namespace) -> None:
    s = FidelitySession(args.model or default_model_path(), args.eval_tokens, args.cache_dir)
    out = {**s.info, "rows": {}, "search": None}
    rows = []

    def add(name: str, r: dict) -> None:
        rows.append((name, r))
        out["rows"][name] = r
        write_json(args.json, out)
        print(fidelity.format_rows(rows[-1:]).splitlines()[-1], flush=True)

    add("bf16 vs fp32 (noise floor)", s.noise_floor())
    for fmt in filter(None, args.uniform.split(",")):
        add(fmt, s.report({m: fmt for m in s.runner.modules}))
    budgets = [float(b) for b in args.budgets.split(",")]
    formats = args.search_formats.split(",")
    searched = s.search(formats, budgets, args.layers_per_group, args.search_chunks, args.max_trials)
    out["search"] = searched
    write_json(args.json, out)
    for b in budgets:
        add(f"searched @ {b} bits", s.report(searched["budgets"][str(b)]["plan"]))

    print(f"\n{s.info['eval_tokens']} scored tokens ({s.info['chat_prompts']} chat answers + stdlib text), "
          f"reference fp32 pass {s.seconds_per_pass:.0f}s\n")  # fmt: skip
    print(fidelity.format_rows(rows))
    print(f"\nsearch on {searched['search_tokens']} tokens; whole configs measured vs the sum of their parts:")
    for b in budgets:
        for t in searched["budgets"][str(b)]["trials"]:
            ratio = t["measured_kl"] / t["sum_of_parts"] if t["sum_of_parts"] else float("nan")
            print(f"  budget {b}: {t['move']:<26} {t['avg_bits']:.2f} bits  measured {t['measured_kl']:.5f}  "
                  f"sum of parts {t['sum_of_parts']:.5f}  ratio {ratio:.2f}  "
                  f"{'CANCELLED' if t['cancelled'] else 'super-additive'}  accepted={t['accepted']}")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
