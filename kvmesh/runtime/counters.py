"""Exporting a core's plain counters to Prometheus, read at scrape time.

Cores keep their counts in a dataclass of ints (no metrics library inside
the logic); the service registers one of these to publish every field as a
``<prefix>_<field>_total`` counter, plus any gauges it names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class CountersCollector(Collector):
    def __init__(
        self,
        prefix: str,
        counters: Callable[[], object],
        gauges: Callable[[], Mapping[str, tuple[float, str]]] = dict,
        skip: frozenset[str] = frozenset(),
    ) -> None:
        """``counters()`` returns the dataclass to export; ``gauges()`` maps name -> (value, help);
        fields named in ``skip`` are gauges in disguise (they go up and down) and left out."""
        self.prefix = prefix
        self.counters = counters
        self.gauges = gauges
        self.skip = skip

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        c = self.counters()
        for f in dataclasses.fields(c):
            if f.name not in self.skip:
                label = f.name.replace("_", " ")
                yield CounterMetricFamily(
                    f"{self.prefix}_{f.name}", f"{self.prefix} {label}.", value=getattr(c, f.name)
                )
        for name, (value, help_text) in self.gauges().items():
            yield GaugeMetricFamily(f"{self.prefix}_{name}", help_text, value=value)
