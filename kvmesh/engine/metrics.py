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


class EngineCollector(Collector):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

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
        }
        for name, value in gauges.items():
            yield GaugeMetricFamily(f"kvmesh_engine_{name}", f"Engine {name.replace('_', ' ')}.", value=value)
