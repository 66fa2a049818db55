"""An engine's load under vLLM's metric names, so vLLM's Grafana dashboard, KEDA triggers and llm-d's
scorers read a kvmesh worker unchanged.

vLLM names its engine's gauges and counters ``vllm:*`` with a ``model_name`` label (and ``engine``, the
engine index in its process: always "0" here, one engine per worker). The request-level histograms
(time to first token, end-to-end latency) are the gateway's: it is where a request's whole life is seen
(``services/gateway/vllm_metrics.py``). The ``kvmesh_engine_*`` names stay the project's own.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.engine.engine import LLMEngine

LABELS = ("model_name", "engine")


class VllmEngineCollector(Collector):
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        """``model_name``: the id requests use for this model (the gateway's default: the folder's name)."""
        self.engine = engine
        self._labels = [model_name, "0"]

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        e = self.engine
        blocks = e.blocks
        usage = (blocks.num_blocks - blocks.num_free) / blocks.num_blocks if blocks.num_blocks else 0.0
        gauges = {
            "vllm:num_requests_running": ("Requests in model execution batches.", e.num_running),
            "vllm:num_requests_waiting": ("Requests waiting to be processed.", e.num_waiting),
            "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", usage),
            # The name vLLM used before kv_cache_usage_perc, which older dashboards still query.
            "vllm:gpu_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", usage),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(self._labels, value)
            yield gauge
        s = e.stats
        counters = {
            "vllm:prompt_tokens": ("Number of prefill tokens processed.", s.prompt_tokens),
            "vllm:generation_tokens": ("Number of generation tokens processed.", s.generated_tokens),
            "vllm:num_preemptions": ("Cumulative number of preemptions from the engine.", s.preemptions),
            "vllm:prefix_cache_queries": (
                "Prefix cache queries, in terms of number of queried tokens.",
                s.prompt_tokens,
            ),
            "vllm:prefix_cache_hits": (
                "Prefix cache hits, in terms of number of cached tokens.",
                s.cached_prompt_tokens,
            ),
        }
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(self._labels, value)
            yield counter
