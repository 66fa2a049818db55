"""The speculator service's entry point: ``python -m services.speculator.main``.

By default it holds no model: drafts come from n-gram matches in each
request's own context and from a shared index of finished sequences, so it
starts at once and runs on CPU next to any number of decode workers.

With ``--draft-model`` it also runs a small draft model (on its own thread,
on ``--draft-model-device``) whose greedy drafts fill in where the n-gram
matches are short or missing. The service never sees the target model, so
the operator must give it a draft model that shares the target's tokenizer
(the same token ids, e.g. ``models/pycode-draft`` for ``models/pycode-small``):
its drafts are token ids the decode workers verify as their own. With another
tokenizer the drafts are wrong ids, which verification rejects (the output is
unchanged, the work wasted); ids beyond the draft model's vocabulary leave
their message with n-gram drafts only (logged once). A folder that does not
load stops the service before it starts (exit 2).
"""

from __future__ import annotations

import argparse

from kvmesh.api.speculator.v1 import speculator_pb2, speculator_pb2_grpc
from kvmesh.runtime import Flag, GrpcService, ServiceContext, ServiceDef, run
from kvmesh.speculation.metrics import SpeculatorCollector
from kvmesh.speculation.speculator import DRAFT_MODEL_MATCH_TOKENS, Speculator, SpeculatorConfig
from services.speculator.maintenance import IndexMaintainer
from services.speculator.server import SpeculatorServicer

_DEFAULTS = SpeculatorConfig()


def ngram_sizes(raw: str) -> tuple[int, ...]:
    """``"4,3,2"`` -> (4, 3, 2): positive sizes, any order."""
    sizes = tuple(int(part) for part in raw.split(",") if part.strip())
    if not sizes or min(sizes) < 1:
        raise ValueError("expected comma-separated positive n-gram sizes, e.g. 4,3,2")
    return sizes


def draft_model_folder(raw: str) -> str:
    """A model folder that loads into kvmesh's engine: config, tokenizer and every weight
    (names, shapes, readable files), loaded onto PyTorch's meta device, which allocates nothing."""
    from kvmesh.engine.config import EngineConfig  # torch: only a speculator with a draft model needs it
    from kvmesh.engine.engine import LLMEngine  # torch: only a speculator with a draft model needs it

    try:
        LLMEngine(raw, EngineConfig(device="meta", num_blocks=1))
    except Exception as e:  # whatever stops it loading, the service must not start with it
        raise ValueError(f"{raw} does not load as a model folder: {e}") from None
    return raw


FLAGS = [
    Flag(
        "--prompt-ngram-sizes",
        "n-gram sizes matched in a request's own context (prompt lookup)",
        default=_DEFAULTS.prompt_ngram_sizes,
        type=ngram_sizes,
    ),
    Flag(
        "--suffix-ngram-sizes",
        "n-gram sizes matched in the shared index of finished sequences",
        default=_DEFAULTS.suffix_ngram_sizes,
        type=ngram_sizes,
    ),
    Flag("--max-draft-tokens", "most draft tokens proposed per update", default=_DEFAULTS.max_draft_tokens, type=int),
    Flag(
        "--suffix-capacity-tokens",
        "tokens the shared index holds before evicting the oldest sequences",
        default=_DEFAULTS.suffix_capacity_tokens,
        type=int,
    ),
    Flag(
        "--draft-model",
        "local Hugging Face folder of a draft model that shares the target model's tokenizer "
        "(same token ids): its greedy drafts fill in where n-gram matches are weak (unset: n-gram drafts only)",
        type=draft_model_folder,
    ),
    Flag("--draft-model-device", "torch device the draft model runs on, e.g. cpu or cuda:0", default="cpu"),
    Flag(
        "--draft-model-match-tokens",
        "the n-gram match length the draft model's drafts count as: n-gram drafts "
        "matching at least this many tokens of the context's tail win over them",
        default=DRAFT_MODEL_MATCH_TOKENS,
        type=int,
    ),
    Flag(
        "--min-match-tokens",
        "propose only n-gram drafts matching at least this many tokens (for decode "
        "workers with an --eagle-head, which draft where this answers nothing)",
        default=0,
        type=int,
    ),
    Flag(
        "--retain-traffic",
        "opt-in: append every finished sequence's tokens to this JSONL file, the "
        "training data of `kvmesh train-speculator --data traffic=PATH` (unset: no data kept)",
    ),
]


def config_from_args(args: argparse.Namespace) -> SpeculatorConfig:
    return SpeculatorConfig(
        prompt_ngram_sizes=args.prompt_ngram_sizes,
        suffix_ngram_sizes=args.suffix_ngram_sizes,
        max_draft_tokens=args.max_draft_tokens,
        suffix_capacity_tokens=args.suffix_capacity_tokens,
        defer_indexing=True,
        draft_model_match_tokens=args.draft_model_match_tokens if args.draft_model else None,
        min_match_tokens=args.min_match_tokens,
        retain_traffic=args.retain_traffic,
    )


def build(ctx: ServiceContext) -> ServiceDef:
    args = ctx.args
    speculator = Speculator(config_from_args(args))
    maintainer = IndexMaintainer(speculator)
    draft_model = None
    if args.draft_model:
        from services.speculator.draft_worker import DraftModelWorker  # torch: only with a draft model

        draft_model = DraftModelWorker(args.draft_model, args.draft_model_device, speculator.config.max_draft_tokens)
    servicer = SpeculatorServicer(speculator, maintainer, draft_model)
    ctx.registry.register(SpeculatorCollector(speculator))

    async def start() -> None:
        if draft_model is not None:
            try:
                await draft_model.start()
            except BaseException:
                await draft_model.close()
                raise
        maintainer.start()

    async def stop() -> None:
        await maintainer.stop()
        if draft_model is not None:
            await draft_model.close()

    return ServiceDef(
        services=[GrpcService.of(speculator_pb2, speculator_pb2_grpc, "SpeculatorService", servicer)],
        start=start,
        drain=servicer.drain,
        stop=stop,
    )


def main() -> None:
    run("speculator", build, flags=FLAGS, default_port=50056, default_metrics_port=9106)


if __name__ == "__main__":
    main()
