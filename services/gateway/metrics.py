"""The gateway's own Prometheus metrics (the runtime adds the per-RPC ones)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.gateway.vllm_metrics import VllmRequestMetrics

# From a cached one-block prompt on a GPU to a long prompt prefilled on CPU.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        """``model_name``: the served model's id, the label of the vLLM-named metrics (``vllm``)."""
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self.vllm = VllmRequestMetrics(reg, model_name)
        self.requests = Counter(
            "kvmesh_gateway_requests",
            "Generation requests finished, by API method and outcome (ok, cancelled, or a status code name).",
            ["method", "outcome"],
            registry=reg,
        )
        self.inflight = Gauge(
            "kvmesh_gateway_inflight_requests", "Generation requests admitted and not yet finished.", registry=reg
        )
        self.ttft = Histogram(
            "kvmesh_gateway_time_to_first_token_seconds",
            "From receiving a request to sending its first token.",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.inter_token = Histogram(
            "kvmesh_gateway_inter_token_latency_seconds",
            "Time between consecutive tokens sent to a client (a chunk of k tokens counts k times gap/k).",
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.tokens = Counter("kvmesh_gateway_generated_tokens", "Tokens streamed to clients.", registry=reg)
        self.retries = Counter(
            "kvmesh_gateway_retries",
            "Requests retried on another worker after a worker failed before the first token, by failed stage.",
            ["stage"],
            registry=reg,
        )
        self.migrations = Counter(
            "kvmesh_gateway_migrations",
            "Streams whose decode worker failed mid-stream, by outcome: resumed (moved to another worker), "
            "no_worker (none left to resume on), limit (the request's migrations were used up).",
            ["outcome"],
            registry=reg,
        )
        self.phases = Histogram(
            "kvmesh_gateway_request_phase_seconds",
            "Where finished requests' time went, by phase (services.gateway.timing: tokenize, route, "
            "prefill_queue, prefill, kvstore, kv_transfer, decode_queue, first_token, total).",
            ["phase"],
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.cached_tokens = Counter(
            "kvmesh_gateway_prompt_cached_tokens",
            "Prompt tokens of finished requests the router predicted the serving worker would find cached, and "
            "those it found (kind: predicted, found); found / predicted is the routing index's precision.",
            ["kind"],
            registry=reg,
        )
        self.router_fallbacks = Counter(
            "kvmesh_gateway_router_fallbacks",
            "Requests routed on the last known decode workers because the router could not be reached.",
            registry=reg,
        )


class HttpMetrics:
    """The OpenAI HTTP API's requests, the way the runtime counts RPCs."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "kvmesh_http_requests",
            'HTTP requests finished, by route and status ("cancelled": the client hung up).',
            ["route", "status"],
            registry=reg,
        )
        self.duration = Histogram(
            "kvmesh_http_request_duration_seconds",
            "HTTP request duration, to the end of the body (whole stream for streamed responses).",
            ["route"],
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
