"""Node mode: when every process is read again (the full owner scan, which alone may call a
segment leaked). As cAdvisor's housekeeping does, its interval doubles after a scan that found
nothing changed since the one before (no segment created, deleted or written, no mount come,
gone or moved, the same holders, none called leaked), up to `cap` times the base, and is back
to the base on any change."""

from __future__ import annotations

from typing import Callable, Optional

from exporter.inventory.holdings import Owners


class ScanPace:
    def __init__(self, base: float, cap: int, monotonic: Callable[[], float]):
        self.base = self.every = base
        self.cap, self.monotonic = cap, monotonic
        self.scanned_at = float("-inf")
        self._quiet = False  # nothing changed since the last scan
        self._seen: tuple = ()  # the last scan's mounts, holders and keys held

    def due(self) -> bool:
        return self.monotonic() - self.scanned_at >= self.every

    def changed(self) -> None:
        self._quiet, self.every = False, self.base

    def look(self, mounts: tuple, owners: Optional[Owners] = None) -> None:
        """A full run's mounts (devices, statvfs), and a refresh's owners."""
        if self._seen[:1] != (mounts,) or owners and _held(owners) != self._seen[1:]:
            self.changed()

    def scanned(self, mounts, owners: Owners, leaked, quiet, stretch) -> None:
        """`leaked`: the scan called a segment so (one a process attaches to without writing
        is seen by a full scan only); `quiet`: nothing changed while it read /proc; `stretch`:
        inotify watches every mount."""
        calm = self._quiet and stretch and not leaked
        calm = calm and self._seen[1:] == _held(owners)
        self.every = min(self.every * 2, self.base * self.cap) if calm else self.base
        self._seen = (mounts, dict(owners.holders), frozenset(owners.holdings))
        self._quiet, self.scanned_at = quiet, self.monotonic()


def _held(owners: Owners) -> tuple:
    return owners.holders, owners.holdings.keys()
