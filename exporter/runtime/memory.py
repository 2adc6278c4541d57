"""Heap given back to the kernel once the segment inventory shrank by many files: a leak
storm's rows are freed when its files go, but glibc keeps the pages it freed until asked
(malloc_trim). The serving process allocates Python's objects with glibc too (__main__.py)."""

import time
from typing import Callable

from exporter.host.libc import release_memory
from exporter.model.types import Inventory, Observation

SHRUNK = (
    10_000  # files fewer than the most listed since the last give-back: worth a trim
)
# After a storm's give-back, again on AGAIN later runs this far apart: what was freed since
# (inotify events still queued for the watcher, the inventories and renders before).
SETTLE_SECONDS = 10.0
AGAIN = 3


class MemoryGiveBack:
    """A scheduler subscriber, after the model step: the model then holds the new inventory
    only, so what the one before held alone is freed already. Runs on the thread that
    publishes the segments source's runs (a timed-out run, published by the watchdog, has no
    result and counts nothing)."""

    def __init__(
        self,
        release: Callable[[], None] = release_memory,
        shrunk: int = SHRUNK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.release, self.shrunk, self.clock = release, shrunk, clock
        self._most = (
            0  # most files listed since memory was last given back for a shrink
        )
        self._again = 0  # give-backs still due after the last shrink
        self._given_at = float("-inf")

    def on_observation(self, obs: Observation) -> None:
        """Against the most listed since the last give-back: a storm deleted over many quick
        runs, each fewer than `shrunk`, is given back too."""
        if obs.source != "segments" or not isinstance(obs.result, Inventory):
            return
        files, now = sum(m.files for m in obs.result.mounts), self.clock()
        shrank = max(self._most, files) - files >= self.shrunk
        self._most = files if shrank else max(self._most, files)
        if shrank:
            self._again = AGAIN
        elif self._again and now - self._given_at >= SETTLE_SECONDS:
            self._again -= 1
        else:
            return
        self._given_at = now
        self.release()
