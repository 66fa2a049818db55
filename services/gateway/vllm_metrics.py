"""Each request's life under vLLM's metric names (``vllm:*`` with ``model_name``), beside ``kvmesh_gateway_*``.

The gateway is where a request's whole life is seen, so the request-level histograms vLLM's dashboard
reads are observed here; the engine gauges (running, waiting, KV usage) come from the workers
(``kvmesh/engine/vllm_metrics.py``). The buckets are vLLM's, so its dashboard's quantiles read the same.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_TTFT_BUCKETS += (40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
_LATENCY_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


class VllmRequestMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token.", _TTFT_BUCKETS)
        self.inter_token = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency.", _LATENCY_BUCKETS
        )
        self.prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed per request.", _TOKEN_BUCKETS
        )
        self.generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed per request.", _TOKEN_BUCKETS
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self._model_name = model_name

    def finished(self, reason: str, seconds: float, prompt_tokens: int, generation_tokens: int) -> None:
        """A request that ended with ``reason`` (vLLM's words: stop, length, abort)."""
        self.e2e.observe(seconds)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        self._success.labels(self._model_name, reason).inc()
