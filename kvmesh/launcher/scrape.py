"""Reading a mesh process's Prometheus metrics: what tests, benchmarks and operators' scripts look at."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.launcher.spec import ProcessSpec


def scrape(spec: ProcessSpec, timeout_s: float = 10.0) -> dict[str, float]:
    """The process's /metrics as {name: value}, labelled samples as ``name{k=v,...}`` (labels sorted).
    Raises OSError when the process does not answer."""
    url = f"http://{spec.host}:{spec.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out
