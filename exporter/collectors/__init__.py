"""Sources. One module per source; each returns plain dataclasses, never metric objects.

A collector is any object with a `name`, a `schedule` ("poll": every --poll-interval,
"inventory": every --inventory-interval and on inotify events) and a `collect()`
that returns its result or raises. The sampler runs it; metrics.py renders it.
"""
from __future__ import annotations

from typing import Protocol


class Collector(Protocol):
    name: str
    schedule: str

    def collect(self) -> object: ...
