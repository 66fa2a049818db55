"""The speculator's Prometheus metrics, read from the core at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.speculation.speculator import Speculator


class SpeculatorCollector(Collector):
    def __init__(self, speculator: Speculator) -> None:
        self._spec = speculator

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._spec.stats()
        yield CounterMetricFamily(
            "kvmesh_speculator_proposed_tokens", "Draft tokens sent to decode workers.", value=s.proposed_tokens
        )
        yield CounterMetricFamily(
            "kvmesh_speculator_accepted_tokens",
            "Draft tokens the decode workers' verification accepted (as they report it).",
            value=s.accepted_tokens,
        )
        yield GaugeMetricFamily(
            "kvmesh_speculator_acceptance_ratio",
            "Accepted / proposed draft tokens since start (0 before any proposal).",
            value=s.acceptance_rate,
        )
        proposals = CounterMetricFamily(
            "kvmesh_speculator_proposals", "Drafts sent, by the source that won.", labels=["source"]
        )
        for source, n in s.proposals.items():
            proposals.add_metric([source], n)
        yield proposals
        by_source = [
            ("kvmesh_speculator_source_proposed_tokens", "Draft tokens proposed, by source.", s.proposed_by_source),
            (
                "kvmesh_speculator_source_accepted_tokens",
                "Draft tokens accepted, by the source that proposed them.",
                s.accepted_by_source,
            ),
        ]
        for name, doc, counts in by_source:
            family = CounterMetricFamily(name, doc, labels=["source"])
            for source, n in counts.items():
                family.add_metric([source], n)
            yield family
        yield CounterMetricFamily(
            "kvmesh_speculator_late_drafts",
            "Draft requests left unanswered because their deadline passed first.",
            value=s.late_drafts,
        )
        yield GaugeMetricFamily(
            "kvmesh_speculator_active_requests", "Sequences with live state.", value=s.active_requests
        )
        yield GaugeMetricFamily(
            "kvmesh_speculator_indexed_tokens", "Tokens in the shared suffix index.", value=s.indexed_tokens
        )
        yield GaugeMetricFamily(
            "kvmesh_speculator_indexed_sequences",
            "Finished sequences held in the shared suffix index.",
            value=s.indexed_sequences,
        )
        yield GaugeMetricFamily(
            "kvmesh_speculator_indexing_backlog_tokens",
            "Learned tokens waiting to be indexed.",
            value=s.indexing_backlog_tokens,
        )
