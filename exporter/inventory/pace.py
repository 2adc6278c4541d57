"""Node mode: when every process is read again (the full owner scan, which alone may call a
segment leaked). As cAdvisor's housekeeping does, its interval doubles after a scan that found
nothing changed since the one before (no segment created, deleted or written, no mount come,
gone or moved, the same holders, none called leaked), up to `cap` times the base, and is back
to the base on any change."""

from typing import Callable, Optional

from exporter.inventory.holdings import Owners


class ScanPace:
    def __init__(self, base: float, cap: int, monotonic: Callable[[], float]):
        self.base = self.every = base
        self.cap, self.monotonic = cap, monotonic
        self.scanned_at = float("-inf")
        self._quiet = False  # nothing changed since the last scan
        # What the last full scan found, to tell a change from: (each mount's device and
        # statvfs figures, the holders, the (device, inode) keys held).
        self._seen: Optional[tuple] = None

    def due(self) -> bool:
        return self.monotonic() - self.scanned_at >= self.every

    def changed(self) -> None:
        self._quiet, self.every = False, self.base

    def _same(self, owners: Owners) -> bool:
        seen = self._seen
        return seen is not None and seen[1:] == (owners.holders, owners.holdings.keys())

    def look(self, mounts: tuple, owners: Optional[Owners] = None) -> None:
        """A full run's mounts, and a refresh's owners: a change from the last scan's?"""
        if (
            not self._seen
            or self._seen[0] != mounts
            or owners
            and not self._same(owners)
        ):
            self.changed()

    def scanned(
        self, mounts: tuple, owners: Owners, *, quiet: bool, stretch: bool
    ) -> None:
        """`quiet`: nothing changed while it read /proc; `stretch`: inotify watches every
        mount and nothing is called leaked (one a process attaches to without writing is
        seen by a full scan only)."""
        calm = self._quiet and quiet and stretch and self._same(owners)
        self.every = min(self.every * 2, self.base * self.cap) if calm else self.base
        self._seen = (mounts, dict(owners.holders), frozenset(owners.holdings))
        self._quiet, self.scanned_at = quiet, self.monotonic()
