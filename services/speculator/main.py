"""The speculator service's entry point: ``python -m services.speculator.main``.

Holds no model: drafts come from n-gram matches in each request's own
context and from a shared index of finished sequences, so it starts at once
and runs on CPU next to any number of decode workers.
"""

from __future__ import annotations

import argparse

from kvmesh.runtime import Flag, GrpcService, ServiceContext, ServiceDef, run
from kvmesh.speculator.v1 import speculator_pb2, speculator_pb2_grpc
from services.speculator.core import Speculator, SpeculatorConfig
from services.speculator.maintenance import IndexMaintainer
from services.speculator.metrics import SpeculatorCollector
from services.speculator.server import SpeculatorServicer

_DEFAULTS = SpeculatorConfig()


def ngram_sizes(raw: str) -> tuple[int, ...]:
    """``"4,3,2"`` -> (4, 3, 2): positive sizes, any order."""
    sizes = tuple(int(part) for part in raw.split(",") if part.strip())
    if not sizes or min(sizes) < 1:
        raise ValueError("expected comma-separated positive n-gram sizes, e.g. 4,3,2")
    return sizes


FLAGS = [
    Flag("--prompt-ngram-sizes", "n-gram sizes matched in a request's own context (prompt lookup)",
         default=_DEFAULTS.prompt_ngram_sizes, type=ngram_sizes),
    Flag("--suffix-ngram-sizes", "n-gram sizes matched in the shared index of finished sequences",
         default=_DEFAULTS.suffix_ngram_sizes, type=ngram_sizes),
    Flag("--max-draft-tokens", "most draft tokens proposed per update", default=_DEFAULTS.max_draft_tokens, type=int),
    Flag("--suffix-capacity-tokens", "tokens the shared index holds before evicting the oldest sequences",
         default=_DEFAULTS.suffix_capacity_tokens, type=int),
]


def config_from_args(args: argparse.Namespace) -> SpeculatorConfig:
    return SpeculatorConfig(
        prompt_ngram_sizes=args.prompt_ngram_sizes,
        suffix_ngram_sizes=args.suffix_ngram_sizes,
        max_draft_tokens=args.max_draft_tokens,
        suffix_capacity_tokens=args.suffix_capacity_tokens,
        defer_indexing=True,
    )


def build(ctx: ServiceContext) -> ServiceDef:
    speculator = Speculator(config_from_args(ctx.args))
    maintainer = IndexMaintainer(speculator)
    servicer = SpeculatorServicer(speculator, maintainer)
    ctx.registry.register(SpeculatorCollector(speculator))

    async def start() -> None:
        maintainer.start()

    return ServiceDef(
        services=[
            GrpcService(
                speculator_pb2.DESCRIPTOR.services_by_name["SpeculatorService"],
                speculator_pb2_grpc.add_SpeculatorServiceServicer_to_server,
                servicer,
            )
        ],
        start=start,
        drain=servicer.drain,
        stop=maintainer.stop,
    )


def main() -> None:
    run("speculator", build, flags=FLAGS, default_port=50056, default_metrics_port=9106)


if __name__ == "__main__":
    main()
