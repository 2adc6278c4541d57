"""Sources. One module per source; each returns one dataclass type in every mode, never
metric objects.

A source is any object with a `name`, a `schedule` ("poll": every --poll-interval,
"inventory": every --inventory-interval) and a `collect()` that returns its result or
raises; `event_driven = True` also runs it early when inotify sees a mount change
(`collect_quick()` when it has one). The sampler runs it; the model step joins what it
returned; metrics.py and check.py render the model.
"""

from __future__ import annotations

from typing import Protocol


class Collector(Protocol):
    name: str
    schedule: str

    def collect(self) -> object: ...
