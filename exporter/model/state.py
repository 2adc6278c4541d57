"""What outlives one observation per mount: peaks, high-water marks, event counters and
inotify flags, fed by the model step and the watcher; `version` moves with a change."""

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional, Set, Tuple

from exporter.model.types import MountUsage


class PeakWindow:
    """Sliding-window maximum (monotonic deque): O(1) amortised per sample."""

    def __init__(self, window: float):
        self.window = window
        self._samples: deque = deque()  # (time, value), values falling

    def add(self, now: float, value: int) -> None:
        while self._samples and self._samples[-1][1] <= value:
            self._samples.pop()
        self._samples.append((now, value))
        self.peak(now)  # expires the old: unscraped, the deque stays short

    def peak(self, now: float) -> Optional[int]:
        """The window's highest value; the latest one, however old, if none is newer."""
        while len(self._samples) > 1 and self._samples[0][0] < now - self.window:
            self._samples.popleft()
        return self._samples[0][1] if self._samples else None


@dataclass(frozen=True)
class MountStates:  # a copy of the store, for one model step
    peaks: Dict[str, int]
    max_used: Dict[str, Tuple[int, float]]  # mount -> (highest used bytes, wall clock)
    event_rows: Dict[str, Tuple[Tuple[str, str, int], ...]]  # sorted (a render's key)
    inotify: Dict[str, bool]
    overflows: Dict[str, int]  # mount -> inotify queue overflows while it was watched


@dataclass
class _Mount:  # what the store keeps of one mount
    peak: PeakWindow
    max_used: Optional[Tuple[int, float]] = None  # (highest used bytes, wall clock)
    events: Counter = field(default_factory=Counter)  # (class, event) -> count
    inotify: Optional[bool] = None  # None: not said yet
    overflows: int = 0
    instance: Optional[tuple] = None  # the mount instance last polled (None: not yet)
    live: bool = True  # False while the last poll found it gone: no samples taken


class StateStore:
    # clock: the peak window's; wall_clock: when the high-water mark was reached.
    def __init__(self, peak_window=60.0, clock=time.monotonic, wall_clock=time.time):
        self.peak_window, self.clock, self.wall_clock = peak_window, clock, wall_clock
        self._lock = threading.Lock()
        self._version = 0
        self._mounts: Dict[str, _Mount] = {}
        self._touched: Set[str] = set()  # mounts inotify saw change, for shm_mount

    def version(self) -> int:
        return self._version

    def _of(self, mount: str) -> _Mount:
        """The mount's record (under the lock), made on first use; the version moves."""
        self._version += 1
        if mount not in self._mounts:
            self._mounts[mount] = _Mount(PeakWindow(self.peak_window))
        return self._mounts[mount]

    def touch(self, mount: str) -> None:
        """inotify saw `mount` change (the watcher); drained by shm_mount's next run."""
        with self._lock:
            self._touched.add(mount)

    def drain_touched(self) -> Set[str]:
        with self._lock:
            touched, self._touched = self._touched, set()
        return touched

    def record_polled(self, usages: Iterable[MountUsage]) -> None:
        """One poll's mounts. Another instance at a path (remounted, or gone in between) starts
        its peak and high-water mark afresh: the old mount's say nothing of the new one's size."""
        now = self.clock()
        with self._lock:
            for u in usages:
                record = self._of(u.mount)
                # () with no error: the mount table could not say which (proves nothing).
                instance = u.instance or (("gone",) if u.error else ())
                if instance and record.instance and instance != record.instance:
                    record.peak, record.max_used = PeakWindow(self.peak_window), None
                record.instance = instance or record.instance
                record.live = not u.error
                if record.live:
                    self._used(record, u.used_bytes, now)

    def record_used(self, usages: Iterable[Tuple[str, int]]) -> None:
        """(mount, used bytes) pairs under one lock; a mount the last poll found gone takes
        none (the watcher's statvfs would measure the disk beneath)."""
        now = self.clock()
        with self._lock:
            for mount, used_bytes in usages:
                if mount in self._mounts and not self._mounts[mount].live:
                    continue
                self._used(self._of(mount), used_bytes, now)

    def _used(self, record: _Mount, used_bytes: int, now: float) -> None:
        record.peak.add(now, used_bytes)
        if record.max_used is None or used_bytes > record.max_used[0]:
            record.max_used = (used_bytes, self.wall_clock())

    def count_event(self, mount: str, cls: str, event: str, n: int = 1) -> None:
        with self._lock:
            self._of(mount).events[cls, event] += n

    def count_overflow(self, mount: str) -> None:
        with self._lock:
            self._of(mount).overflows += 1

    def set_inotify(self, mount: str, active: bool) -> None:
        with self._lock:
            record = self._mounts.get(mount)
            if record is None or record.inotify != active:
                self._of(mount).inotify = active

    def inotify_active(self, mount: str) -> bool:
        with self._lock:
            record = self._mounts.get(mount)
            return bool(record and record.inotify)

    def all_inotify(self) -> bool:
        with self._lock:
            flags = [r.inotify for r in self._mounts.values() if r.inotify is not None]
        return bool(flags) and all(flags)

    def forget_mounts_except(self, mounts: Iterable[str]) -> None:
        """A mount that went away (a pod deleted) takes its peaks, counters and flags with it."""
        keep = set(mounts)
        with self._lock:
            kept = {m: record for m, record in self._mounts.items() if m in keep}
            self._version += len(self._mounts) - len(kept)
            self._mounts = kept

    def snapshot(self) -> MountStates:
        now = self.clock()
        with self._lock:
            mounts = self._mounts.items()
            return MountStates(
                {m: p for m, r in mounts if (p := r.peak.peak(now)) is not None},
                {m: r.max_used for m, r in mounts if r.max_used is not None},
                {
                    m: tuple(sorted((*k, n) for k, n in r.events.items()))
                    for m, r in mounts
                    if r.events
                },
                {m: r.inotify for m, r in mounts if r.inotify is not None},
                {m: r.overflows for m, r in mounts if r.overflows},
            )
