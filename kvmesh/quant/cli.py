"""``kvmesh quantize``: write a quantized checkpoint and its fidelity report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvmesh.checkpoint.format_names import FORMAT_NAMES
from kvmesh.models.sources import REVISION_HELP

SEARCH_FORMATS = "fp8-channel,nvfp4"


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="quantize a model's weights; write the checkpoint and a fidelity report")
    p.add_argument(
        "--model",
        help="the unquantized model: a folder, or a hub id (org/name) in the Hugging Face cache (default: the "
        "default model)",
    )
    p.add_argument("--revision", help=REVISION_HELP)
    p.add_argument("--out", required=True, help="folder to write the quantized checkpoint and fidelity.json to")
    p.add_argument("--format", choices=sorted(FORMAT_NAMES), help="one format for every decoder projection")
    p.add_argument("--plan", choices=("auto",), help="auto: search a per-layer-group plan under --budget-bits")
    p.add_argument("--budget-bits", type=float, help="average stored bits per projection weight (with --plan auto)")
    p.add_argument(
        "--search-formats", default=SEARCH_FORMATS, help=f"formats the search picks from (default {SEARCH_FORMATS})"
    )
    p.add_argument(
        "--layers-per-group", type=int, default=5, help="layers per sensitivity group (attention and MLP apart)"
    )
    p.add_argument("--search-chunks", type=int, default=4, help="eval chunks the search measures on (default 4)")
    p.add_argument("--max-trials", type=int, default=4, help="whole configs the local search measures per budget")
    p.add_argument(
        "--head-format",
        choices=sorted(FORMAT_NAMES),
        help="also quantize the LM head (tied: the embedding) in this format (kept bf16 by default)",
    )
    p.add_argument("--eval-tokens", type=int, default=20000, help="scored tokens of the eval set (default 20000)")
    p.add_argument("--cache-dir", type=Path, help="where the eval set and reference log-probs are cached")
    p.set_defaults(func=_quantize)


def _quantize(args: argparse.Namespace) -> int:
    from kvmesh.engine.default_model import default_model_path
    from kvmesh.errors import InvalidArgument
    from kvmesh.models.sources import resolve_model
    from kvmesh.quant.pipeline import one_thread

    if (args.plan is None) == (args.format is None):
        raise InvalidArgument("give either --format F or --plan auto --budget-bits B")
    if args.plan == "auto" and args.budget_bits is None:
        raise InvalidArgument("--plan auto needs --budget-bits")
    model = resolve_model(args.model, args.revision) if args.model else default_model_path()
    with one_thread():
        return _run(args, model)


def _run(args: argparse.Namespace, model: Path) -> int:
    from kvmesh.checkpoint.compressed import write_checkpoint
    from kvmesh.quant import fidelity
    from kvmesh.quant.pipeline import DEFAULT_CACHE, FidelitySession, write_json

    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    session = FidelitySession(model, args.eval_tokens, args.cache_dir or DEFAULT_CACHE, log=log)
    result: dict = {**session.info}
    if args.plan == "auto":
        formats = args.search_formats.split(",")
        searched = session.search(
            formats, [args.budget_bits], args.layers_per_group, args.search_chunks, args.max_trials
        )
        plan = searched["budgets"][str(args.budget_bits)]["plan"]
        result["search"] = searched
        name = f"auto@{args.budget_bits}bits"
    else:
        plan = {m: args.format for m in session.runner.modules}
        name = args.format
    if args.head_format:
        plan["lm_head"] = args.head_format
        name += f"+head:{args.head_format}"
    write_checkpoint(model, Path(args.out), plan)
    log(f"[quant] wrote {args.out}; evaluating {name} on {session.info['eval_tokens']} tokens")
    rows = [("bf16 vs fp32 (noise floor)", session.noise_floor()), (name, session.report(plan))]
    result.update({"config": name, "plan": plan, "noise_floor": rows[0][1], "fidelity": rows[1][1]})
    write_json(Path(args.out) / "fidelity.json", result)
    print(fidelity.format_rows(rows))
    if "search" in result:
        for t in result["search"]["budgets"][str(args.budget_bits)]["trials"]:
            print(f"  {t['move']:<28} bits {t['avg_bits']:.2f}  measured KL {t['measured_kl']:.5f}  "
                  f"sum of parts {t['sum_of_parts']:.5f}  {'cancelled' if t['cancelled'] else 'additive+'}  "
                  f"accepted={t['accepted']}")  # fmt: skip
    return 0
