"""The ``kvmesh`` command: one entry point for every tool and service."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kvmesh.errors import KvmeshError
from kvmesh.launcher.certs_cli import add_certs_parser
from kvmesh.launcher.cli import add_up_parser
from kvmesh.launcher.health_cli import add_health_parser
from kvmesh.models.cli import add_models_parser
from kvmesh.models.sources import REVISION_HELP
from kvmesh.quant.cli import add_quantize_parser
from kvmesh.sampling import SamplingDefaults
from kvmesh.verify.cli import add_model_check_parser, add_verify_parser

# What `kvmesh generate` runs with where its flags are unset: a look at the model's greedy text.
GENERATE_DEFAULTS = SamplingDefaults(temperature=0.0, max_tokens=64)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run the engine in-process on one prompt and stream the text")
    p.add_argument(
        "--model",
        help="a local Hugging Face folder, or a hub id (org/name) in the Hugging Face cache, offline "
        "(default: the embedded default model)",
    )
    p.add_argument("--revision", help=REVISION_HELP)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    # Unset flags take generate's defaults (GENERATE_DEFAULTS: greedy, 64 tokens), else the API's.
    p.add_argument("--max-tokens", type=int, help=f"default {GENERATE_DEFAULTS.max_tokens}")
    p.add_argument("--temperature", type=float, help="default 0: greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repetition-limit", type=int, help="default 0: off")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: checkpoint's on CUDA, float32 on CPU)")
    p.add_argument("--quantization", choices=("fp8",), help="fp8 weights (CUDA only)")
    p.add_argument("--lora", help="generate under this LoRA adapter (a PEFT folder)")
    p.add_argument(
        "--deterministic", action="store_true", help="batch-invariant execution, as the workers' --deterministic"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes (ranks) of this machine, Megatron-style (on CUDA, a GPU a rank)",
    )
    # engine.config.TP_ALL_REDUCES, spelled out: this parser loads without torch.
    p.add_argument(
        "--tp-all-reduce",
        choices=("shm", "gloo", "nccl"),
        help="how the ranks sum their partial products (default: shm on CPU, nccl on CUDA)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with token_ids, text, finish_reason")
    grammar = p.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", help="constrain the output to this JSON Schema (JSON text)")
    grammar.add_argument("--regex", help="constrain the output to this regular expression")
    grammar.add_argument("--ebnf", help="constrain the output to this EBNF grammar (start rule: root)")
    p.set_defaults(func=_generate)


def _grammar(args: argparse.Namespace):
    from kvmesh.structured.spec import GrammarSpec

    for kind in ("json_schema", "regex", "ebnf"):
        source = getattr(args, kind)
        if source is not None:
            return GrammarSpec(kind, source)
    return None


def _generate(args: argparse.Namespace) -> int:
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.default_model import default_model_path, model_label
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.models.sources import resolve_model

    if args.model is not None:
        model = resolve_model(args.model, args.revision)
    else:
        model = default_model_path()
        print(f"[kvmesh] serving the embedded default model: {model_label(model)}", file=sys.stderr)
    engine = LLMEngine(
        model,
        EngineConfig(
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
            deterministic=args.deterministic,
            tensor_parallel_size=args.tensor_parallel_size,
            tp_all_reduce=args.tp_all_reduce,
        ),
    )
    try:
        return _generate_on(engine, model, args)
    finally:
        engine.close()


def _generate_on(engine, model: object, args: argparse.Namespace) -> int:
    from kvmesh.sampling import SamplingParams, admitted

    if engine.tokenizer is None:
        raise KvmeshError(f"{model}/tokenizer.json: missing; `generate` needs a tokenizer for text prompts")
    text = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    prompt_ids = engine.tokenizer.encode(text, add_special_tokens=not args.chat)
    asked = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        repetition_limit=args.repetition_limit,
        grammar=_grammar(args),
    )
    params = admitted(asked, prompt_ids, engine.model_config.vocab_size, engine.max_model_len, GENERATE_DEFAULTS)
    if args.lora:
        engine.load_adapter("lora", args.lora)
    rid = engine.add_request(prompt_ids, params, adapter="lora" if args.lora else None)
    token_ids: list[int] = []
    parts: list[str] = []
    reason = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            token_ids += out.new_token_ids
            parts.append(out.text_delta)
            if not args.json:
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
            reason = out.finish_reason
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": "".join(parts), "finish_reason": reason}))
    else:
        sys.stdout.write("\n")
    return 0


SERVICES = ("gateway", "router", "prefill", "decode", "kvstore", "speculator")


def _run_service(name: str, argv: list[str]) -> int:
    """``kvmesh <service> [flags]``: the service's own entry point, flags passed through."""
    module = importlib.import_module(f"services.{name}.main")
    sys.argv = [f"kvmesh {name}", *argv]
    module.main()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    add_up_parser(sub)
    add_health_parser(sub)
    add_certs_parser(sub)
    add_model_check_parser(add_models_parser(sub))
    add_quantize_parser(sub)
    add_verify_parser(sub)
    for name in SERVICES:
        sub.add_parser(name, help=f"run the {name} service (its flags: kvmesh {name} --help)", add_help=False)
    sub.add_parser(
        "train-speculator", help="train an EAGLE draft head for a target model (its flags: --help)", add_help=False
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        return _run_service(argv[0], argv[1:])
    if argv and argv[0] == "train-speculator":
        from kvmesh.training.eagle import main as train_speculator

        return train_speculator(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvmeshError as e:
        print(f"kvmesh: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
