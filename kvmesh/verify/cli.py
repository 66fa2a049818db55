"""``kvmesh verify --endpoint URL [--model PATH]``: one table, non-zero exit on any failed check."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvmesh.models.sources import REVISION_HELP


def add_verify_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a served OpenAI-compatible endpoint against transformers on the weights")
    p.add_argument(
        "--endpoint",
        required=True,
        help="the server: the base URL OpenAI clients take (http://127.0.0.1:8000/v1) or its root",
    )
    p.add_argument(
        "--model",
        help="the golden weights: a folder, or a hub id (org/name) in the Hugging Face cache "
        "(default: the default model)",
    )
    p.add_argument("--revision", help=REVISION_HELP)
    p.add_argument("--served-model", help="model name to request (default: the first of GET /v1/models)")
    p.add_argument(
        "--lora",
        type=Path,
        help="a LoRA adapter's PEFT folder: the golden is transformers + PEFT with it (name the served adapter "
        "with --served-model)",
    )
    p.add_argument("--api-key", help="Bearer token for the endpoint")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    # Greedy agreement is exact only on identical weights and arithmetic; faithful quantization
    # still flips near-ties (docs/measurements.md), so the default bound is loose and the KL
    # bound is the tight check.
    p.add_argument(
        "--min-agreement",
        type=float,
        default=0.25,
        help="least fraction of greedy tokens before the first divergence (0.25; 1.0 for same weights)",
    )
    p.add_argument(
        "--max-kl", type=float, default=0.05, help="most mean top-k KL(golden||served) to pass (default 0.05)"
    )
    p.add_argument("--json", type=Path, help="also write the checks and per-prompt rows here")
    p.set_defaults(func=_verify)


def _verify(args: argparse.Namespace) -> int:
    from kvmesh.engine.default_model import default_model_path
    from kvmesh.models.sources import resolve_model
    from kvmesh.verify.checks import Endpoint, greedy_checks, preflight, render, tool_check
    from kvmesh.verify.golden import Golden

    ep = Endpoint(args.endpoint, args.api_key)
    model = args.served_model or ep.model()
    golden = Golden(resolve_model(args.model, args.revision) if args.model else default_model_path(), args.lora)
    checks = preflight(ep, model)
    greedy, rows = greedy_checks(ep, model, golden, args.max_tokens, args.min_agreement, args.max_kl)
    checks += [*greedy, tool_check(ep, model)]
    adapter = f" + PEFT adapter {golden.adapter}" if golden.adapter else ""
    print(f"kvmesh verify: {args.endpoint} (model {model}) against transformers on {golden.path}{adapter}")
    print(render(checks))
    for r in rows:
        if r.get("first_divergence"):
            d = r["first_divergence"]
            margin = "" if d["margin_nats"] is None else f" (golden put it {d['margin_nats']:.2f} nats below its top-1)"
            where = f"  diverged at token {d['token']}: {r['prompt'][:40]!r}:"
            print(f"{where} golden {d['golden']!r} served {d['served']!r}{margin}")
    failed = [c.name for c in checks if not c.ok]
    print("PASS" if not failed else f"FAIL: {'; '.join(failed)}")
    if args.json:
        args.json.write_text(json.dumps({"checks": [c.__dict__ for c in checks], "prompts": rows}, indent=2) + "\n")
    return 1 if failed else 0


def add_model_check_parser(verbs: argparse._SubParsersAction) -> None:
    """``kvmesh models check PATH`` (kvmesh.verify.model_check)."""
    check = verbs.add_parser(
        "check", help="before serving a model folder: config, chat template, tokenizer, greedy and KL vs transformers"
    )
    check.add_argument(
        "path", help="the model folder (config.json, weights, tokenizer), or a hub id (org/name) in the HF cache"
    )
    check.add_argument("--revision", help=REVISION_HELP)
    check.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    check.add_argument("--max-kl", type=float, default=1e-3, help="most mean top-k KL to pass (default 1e-3)")
    check.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    from kvmesh.models.sources import resolve_model
    from kvmesh.verify.checks import render
    from kvmesh.verify.model_check import check_model

    path = resolve_model(args.path, args.revision)
    checks = check_model(path, args.max_tokens, args.max_kl)
    print(f"kvmesh models check: {args.path}" + (f" ({path})" if str(path) != args.path else ""))
    print(render(checks))
    failed = [c.name for c in checks if not c.ok]
    print("PASS" if not failed else f"FAIL: {'; '.join(failed)}")
    return 1 if failed else 0
