"""The exporter's own process_* metrics (prometheus_client's), read per poll, not per scrape."""

from typing import List

from prometheus_client import ProcessCollector

from exporter.collectors.source import RunInput, Source, register
from exporter.model.types import ProcessSample


class SelfProcessCollector(Source):
    name = "process"

    def __init__(self) -> None:
        self._inner = ProcessCollector(registry=None)

    def collect(self, run: RunInput = RunInput()) -> List[ProcessSample]:
        return [
            ProcessSample(name=s.name, value=s.value)
            for f in self._inner.collect()
            for s in f.samples
        ]

    def close(self) -> None:
        """Nothing is kept open between runs."""


register("process", lambda c: SelfProcessCollector(), flag=False)
