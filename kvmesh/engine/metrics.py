"""Prometheus view of an engine: its counters and its KV pool, read at scrape time.

Reading plain ints the engine thread updates is safe enough for metrics (a
scrape may see a value one step old), and costs the step loop nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.moe import expert_tokens


class EngineCollector(Collector):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # A Mixture-of-Experts model's routing counts when serving starts: its warm-up steps are not load.
        self._expert_tokens_at_start = expert_tokens(engine.model)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        e = self.engine
        for f in dataclasses.fields(e.stats):
            yield CounterMetricFamily(
                f"kvmesh_engine_{f.name}", f"Engine counter {f.name}.", value=getattr(e.stats, f.name)
            )
        grammar = e.grammar_stats
        for f in dataclasses.fields(grammar):
            yield CounterMetricFamily(
                f"kvmesh_engine_grammar_{f.name}",
                f"Structured outputs: {f.name.replace('_', ' ')}.",
                value=getattr(grammar, f.name),
            )
        gauges = {
            "running_sequences": e.num_running,
            "waiting_sequences": e.num_waiting,
            "kv_blocks_free": e.blocks.num_free,
            "kv_blocks_total": e.blocks.num_blocks,
            "kv_blocks_cached": e.blocks.num_cached,
            # Blocks referenced by a live sequence or a hand-off: back to 0 when idle.
            "kv_blocks_in_use": e.blocks.num_blocks - e.blocks.num_free,
            # What one token's KV costs in this pool (MLA's latent, or per-head K and V) over every layer.
            "kv_bytes_per_token": e.kv.block_nbytes // e.config.block_size,
        }
        for name, value in gauges.items():
            yield GaugeMetricFamily(f"kvmesh_engine_{name}", f"Engine {name.replace('_', ' ')}.", value=value)
        yield from self._expert_load()

    def _expert_load(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Per expert of each sparse layer, the tokens routed to it; per layer, the busiest expert's share
        over the mean (1: perfectly balanced; E: every token to one expert). Nothing for a dense model."""
        start = self._expert_tokens_at_start
        if not start:
            return
        tokens = CounterMetricFamily(
            "kvmesh_moe_expert_tokens",
            "Tokens routed to each expert since serving started.",
            labels=["layer", "expert"],
        )
        imbalance = GaugeMetricFamily(
            "kvmesh_moe_expert_imbalance",
            "Tokens of a layer's busiest expert over the mean per expert, since serving started.",
            labels=["layer"],
        )
        for layer, counts in expert_tokens(self.engine.model).items():
            served = [now - then for now, then in zip(counts, start[layer])]
            for expert, n in enumerate(served):
                tokens.add_metric([str(layer), str(expert)], n)
            if sum(served):
                imbalance.add_metric([str(layer)], max(served) * len(served) / sum(served))
        yield tokens
        yield imbalance
