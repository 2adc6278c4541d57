"""The exporter's own process_* metrics (prometheus_client's), read per poll, not per scrape."""

from typing import List, Tuple

from prometheus_client import ProcessCollector

from exporter.collectors.source import Source, register

# (sample name, value), e.g. ("process_resident_memory_bytes", 3.1e7)
Sample = Tuple[str, float]


class SelfProcessCollector(Source):
    name = "process"

    def __init__(self) -> None:
        self._inner = ProcessCollector(registry=None)

    def collect(self) -> List[Sample]:
        return [(s.name, s.value) for f in self._inner.collect() for s in f.samples]

    def close(self) -> None:
        """Nothing is kept open between runs."""


register("process", lambda c: SelfProcessCollector(), flag=False)
