"""Entry point of the gateway: ``python -m services.gateway.main``.

It loads the model folder's tokenizer and config only (never the weights) and
talks to the router, prefill and decode workers over gRPC.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from kvmesh.runtime import Flag, ServiceContext, ServiceDef, run
from services.gateway.core import Gateway
from services.gateway.grpc_backends import GrpcBackends
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import ServedModel
from services.gateway.server import gateway_service

log = structlog.get_logger("kvmesh.gateway")

FLAGS = [
    Flag("--router-address", "router host:port", required=True),
    Flag("--model", "local Hugging Face model folder (default: the embedded default model, random weights)"),
    Flag("--model-name", "the model id clients use (default: the folder's name)"),
    Flag("--max-model-len", "context limit (default: the model's; set it like the workers')", type=int),
    Flag("--max-inflight-requests", "generation requests in flight at most; beyond: RESOURCE_EXHAUSTED", default=256, type=int),
    Flag("--rpc-timeout-seconds", "deadline of Route and ReleaseLease calls", default=10.0, type=float),
    Flag("--prefill-timeout-seconds", "deadline of a Prefill call", default=600.0, type=float),
    Flag("--stream-idle-timeout-seconds", "longest silence of a decode stream before it counts as failed",
         default=600.0, type=float),
]


def _model_path(flag: str | None) -> Path:
    if flag:
        return Path(flag)
    from kvmesh.engine.default_model import RANDOM_MODEL_LABEL, default_model_path

    log.warning("no --model: serving the embedded default model", label=RANDOM_MODEL_LABEL)
    return default_model_path()


def build(ctx: ServiceContext) -> ServiceDef:
    args = ctx.args
    model = ServedModel.load(_model_path(args.model), args.model_name, args.max_model_len)
    log.info("model", model=model.name, path=str(model.path), max_model_len=model.max_model_len, label=model.label)
    backends = GrpcBackends(
        args.router_address, rpc_timeout_s=args.rpc_timeout_seconds, prefill_timeout_s=args.prefill_timeout_seconds
    )
    gateway = Gateway(
        model,
        backends,
        max_inflight=args.max_inflight_requests,
        stream_idle_timeout_s=args.stream_idle_timeout_seconds,
        metrics=GatewayMetrics(ctx.registry),
    )

    async def stop() -> None:
        await gateway.wait_idle()  # lease aborts still on their way
        await backends.close()

    return ServiceDef(services=[gateway_service(gateway)], stop=stop)


def main() -> None:
    run("gateway", build, flags=FLAGS, default_port=50051, default_metrics_port=9101)


if __name__ == "__main__":
    main()
