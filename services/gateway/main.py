"""Entry point of the gateway: ``python -m services.gateway.main``.

It loads the model folder's tokenizer and config only (never the weights) and
talks to the router, prefill and decode workers over gRPC. It serves the
public gRPC API and the OpenAI-compatible HTTP API from one process, on one
gateway core, with one set of API keys.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import structlog

from kvmesh.models.sources import REVISION_HELP, ModelSource, resolve_source
from kvmesh.runtime import Flag, ServiceContext, ServiceDef, run
from services.gateway.auth import ApiKeys
from services.gateway.core import Gateway
from services.gateway.generation_defaults import DEFAULT_REPETITION_ALLOW_CHARS, DEFAULT_REPETITION_LIMIT
from services.gateway.grpc_backends import GrpcBackends
from services.gateway.http_app import HttpApi
from services.gateway.http_server import HttpServer
from services.gateway.metrics import GatewayMetrics, HttpMetrics
from services.gateway.migration import DEFAULT_MAX_MIGRATIONS, MigrationPolicy
from services.gateway.model import ServedModel
from services.gateway.responses_store import DEFAULT_TTL_S, LocalResponseStore, RedisResponseStore, ResponseStore
from services.gateway.route_fallback import DEFAULT_HOLD_S, LastKnownWorkers
from services.gateway.server import gateway_service
from services.gateway.tool_calls import AUTO, FORMATS, chosen_format

log = structlog.get_logger("kvmesh.gateway")

FLAGS = [
    Flag("--router-address", "router host:port", required=True),
    Flag(
        "--model",
        "a local Hugging Face model folder, or a hub id (org/name) found in the Hugging Face cache, offline "
        "(default: the installed default model, SmolLM2-135M-Instruct)",
    ),
    Flag("--revision", REVISION_HELP),
    Flag("--model-name", "the model id clients use (default: a hub id as given, else the folder's name)"),
    Flag("--max-model-len", "context limit (default: the model's; set it like the workers')", type=int),
    Flag(
        "--max-inflight-requests",
        "generation requests in flight at most; beyond: RESOURCE_EXHAUSTED",
        default=256,
        type=int,
    ),
    Flag("--rpc-timeout-seconds", "deadline of Route and ReleaseLease calls", default=10.0, type=float),
    Flag("--prefill-timeout-seconds", "deadline of a Prefill call", default=600.0, type=float),
    Flag(
        "--stream-idle-timeout-seconds",
        "longest silence of a decode stream before its first message "
        "(queueing, KV transfer, prefill) before it counts as failed",
        default=600.0,
        type=float,
    ),
    Flag(
        "--token-stall-timeout-seconds",
        "longest silence between a decode stream's messages once tokens flow; "
        "past it the worker counts as hung and the stream migrates",
        default=30.0,
        type=float,
    ),
    Flag(
        "--max-migrations",
        "times one stream may move to another decode worker after its own failed "
        "mid-stream (0: such a stream ends with UNAVAILABLE)",
        default=DEFAULT_MAX_MIGRATIONS,
        type=int,
    ),
    Flag(
        "--router-fallback-seconds",
        "while the router cannot be reached, route on the decode workers it named "
        "last for this long after its last answer, then fail with UNAVAILABLE (0: fail at once)",
        default=DEFAULT_HOLD_S,
        type=float,
    ),
    Flag("--http-host", "address of the OpenAI-compatible HTTP API (default: --host's)"),
    Flag("--http-port", "port of the OpenAI-compatible HTTP API (0: a free port)", default=8000, type=int),
    Flag("--api-keys-file", "file of API keys, one 'key [tenant]' per line (no keys anywhere: auth off)"),
    Flag(
        "--api-keys", "comma-separated 'key [tenant]' entries; prefer KVMESH_API_KEYS or the file to the command line"
    ),
    Flag(
        "--admin-tenants",
        "comma-separated tenants (of the API keys) that may call the admin API: loading and unloading LoRA "
        "adapters (with no API keys at all, anyone may)",
    ),
    Flag(
        "--default-max-tokens",
        "max_tokens of a request that sets none (0: up to the context; the legacy completions API keeps OpenAI's 16)",
        default=0,
        type=int,
    ),
    Flag(
        "--repetition-guard",
        "stop a sequence when one token repeats more than this many times in a row, "
        "unless the request sets its own guard (0: off)",
        default=DEFAULT_REPETITION_LIMIT,
        type=int,
    ),
    Flag(
        "--repetition-guard-allow",
        "tokens made only of these characters may repeat without limit",
        default=DEFAULT_REPETITION_ALLOW_CHARS,
    ),
    Flag(
        "--generation-config",
        "'model': the model folder's generation_config.json gives unset sampling "
        "settings their defaults; 'none': the API's defaults",
        default="model",
        choices=("model", "none"),
    ),
    Flag(
        "--redis-url",
        "Redis keeping stored responses (POST /v1/responses, previous_response_id), shared by every gateway "
        "replica; unset: kept in this process only, so follow-ups must come back to the same replica",
    ),
    Flag("--redis-password-file", "file holding Redis's password (kvmesh certs makes one; unset: none)"),
    Flag(
        "--response-ttl-seconds",
        "how long a stored response can be continued or read back",
        default=DEFAULT_TTL_S,
        type=float,
    ),
    Flag(
        "--tool-call-format",
        "how the model writes tool calls (its chat template must teach the same format); 'auto': the one "
        "the chat template writes (<tool_call>: hermes, [TOOL_CALLS]: mistral, <|python_tag|> or a "
        '"parameters" call: llama3_json; else hermes)',
        default=AUTO,
        choices=(AUTO, *FORMATS),
    ),
    Flag(
        "--lenient-fields",
        "ignore (and log) request fields the HTTP API does not know instead of answering 400 naming them, "
        "for clients that send fields no server serves",
        default=False,
        type=bool,
    ),
]

# Where the runtime's common flags are absent (tests building the gateway with its own
# flags only), the runtime's defaults.
_DEFAULT_HOST = "127.0.0.1"
_DEFAULT_GRACE_SECONDS = 30.0


def _model_source(flag: str | None, revision: str | None = None) -> ModelSource:
    """``--model`` as a folder: itself, a hub id's snapshot in the HF cache, or the installed default model."""
    if flag:
        return resolve_source(flag, revision)
    from kvmesh.engine.default_model import default_model_path, model_label

    path = default_model_path()
    log.info("no --model: serving the installed default model", label=model_label(path))
    return ModelSource(path)


def served_model(args: argparse.Namespace) -> ServedModel:
    """The model the flags name (a folder or a hub id in the HF cache), served under ``--model-name``, else
    the hub id as given, else the folder's name."""
    source = _model_source(args.model, args.revision)
    return ServedModel.load(
        source.path,
        args.model_name or source.name,
        args.max_model_len,
        use_generation_config=args.generation_config == "model",
        max_tokens=args.default_max_tokens,
        repetition_limit=args.repetition_guard,
        repetition_allow_chars=args.repetition_guard_allow,
    )


def build(ctx: ServiceContext) -> ServiceDef:
    args = ctx.args
    model = served_model(args)
    log.info(
        "model",
        model=model.name,
        path=str(model.path),
        max_model_len=model.max_model_len,
        label=model.label,
        defaults=model.defaults.describe(),
    )
    tool_format = chosen_format(args.tool_call_format, model.tokenizer.chat_template)
    log.info("tool calls", format=tool_format.name, chosen_by="template" if args.tool_call_format == AUTO else "flag")
    backends = GrpcBackends(
        args.router_address, rpc_timeout_s=args.rpc_timeout_seconds, prefill_timeout_s=args.prefill_timeout_seconds
    )
    gateway = Gateway(
        model,
        backends,
        max_inflight=args.max_inflight_requests,
        stream_idle_timeout_s=args.stream_idle_timeout_seconds,
        token_stall_timeout_s=args.token_stall_timeout_seconds,
        metrics=GatewayMetrics(ctx.registry, model.name),
        tool_call_format=tool_format,
        migration=MigrationPolicy(args.max_migrations),
        known_workers=LastKnownWorkers(args.router_fallback_seconds),
    )

    keys = _api_keys(args.api_keys_file, args.api_keys, args.admin_tenants)
    log.info("api keys", auth="on" if keys.enabled else "off")
    store = _response_store(args.redis_url, args.redis_password_file, args.response_ttl_seconds)
    api = HttpApi(gateway, keys, ctx.registry, HttpMetrics(ctx.registry), store, lenient_fields=args.lenient_fields)
    http = HttpServer(
        api,
        args.http_host or getattr(args, "host", _DEFAULT_HOST),
        args.http_port,
        getattr(args, "grace_seconds", _DEFAULT_GRACE_SECONDS),
    )

    async def stop() -> None:
        await http.stop()
        await gateway.wait_idle()  # lease aborts still on their way
        await backends.close()
        await store.close()

    return ServiceDef(services=[gateway_service(gateway, keys)], start=http.start, drain=http.drain, stop=stop)


def _api_keys(path: str | None, listed: str | None, admins: str | None) -> ApiKeys:
    try:
        return ApiKeys.load(path, listed, admins)
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: {e.strerror}") from None


def _response_store(url: str | None, password_file: str | None, ttl_s: float) -> ResponseStore:
    if url is None:
        log.info("stored responses", store="in-process")
        return LocalResponseStore(ttl_s)
    password = Path(password_file).read_text().strip() if password_file else None
    log.info("stored responses", store="redis")
    return RedisResponseStore.connect(url, password=password, ttl_s=ttl_s)


def main() -> None:
    run("gateway", build, flags=FLAGS, default_port=50051, default_metrics_port=9101)


if __name__ == "__main__":
    main()
