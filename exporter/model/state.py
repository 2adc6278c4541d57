"""What outlives one observation per mount: peaks, high-water marks, event counters and
inotify flags, fed by the model step (on the thread that publishes shm_mount's runs) and the
watcher (on its threads); `version` moves with a change. One lock."""

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterable, Literal, Optional, Tuple, Union

from exporter.model.types import MountInstance, MountUsage

# A mount the last poll found gone: any instance found after it is another.
GONE: Literal["gone"] = "gone"


@dataclass(frozen=True)
class Sample:
    at: float  # the peak window's clock
    used_bytes: int


class PeakWindow:
    """Sliding-window maximum (monotonic deque): O(1) amortised per sample."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: Deque[Sample] = deque()  # values falling

    def add(self, now: float, value: int) -> None:
        while self._samples and self._samples[-1].used_bytes <= value:
            self._samples.pop()
        self._samples.append(Sample(at=now, used_bytes=value))
        self.peak(now)  # expires the old: unscraped, the deque stays short

    def peak(self, now: float) -> Optional[int]:
        """The window's highest value; the latest one, however old, if none is newer."""
        while len(self._samples) > 1 and self._samples[0].at < now - self.window:
            self._samples.popleft()
        return self._samples[0].used_bytes if self._samples else None


@dataclass(frozen=True)
class HighWaterMark:
    used_bytes: int  # the highest used bytes seen
    at: float  # when it was first reached (wall clock)


@dataclass(frozen=True)
class MountStates:
    """A copy of the store, for one model step."""

    peaks: Dict[str, int]
    max_used: Dict[str, HighWaterMark]
    event_rows: Dict[str, Tuple[Tuple[str, str, int], ...]]  # sorted (a render's key)
    inotify: Dict[str, bool]
    overflows: Dict[str, int]  # mount -> inotify queue overflows while it was watched


@dataclass
class _Mount:
    """What the store keeps of one mount."""

    peak: PeakWindow
    max_used: Optional[HighWaterMark] = None
    events: Counter[Tuple[str, str]] = field(default_factory=Counter)  # (class, event)
    inotify: Optional[bool] = None  # None: not said yet
    overflows: int = 0
    # The mount instance last polled (None: not yet; GONE: the last poll found none).
    instance: Union[MountInstance, Literal["gone"], None] = None
    live: bool = True  # False while the last poll found it gone: no samples taken


class StateStore:
    def __init__(
        self,
        peak_window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock`: the peak window's; `wall_clock`: when a high-water mark was reached."""
        self.peak_window, self.clock, self.wall_clock = peak_window, clock, wall_clock
        self._lock = threading.Lock()
        self._version = 0
        self._mounts: Dict[str, _Mount] = {}

    def version(self) -> int:
        return self._version

    def _of(self, mount: str) -> _Mount:
        """The mount's record (under the lock), made on first use; the version moves."""
        self._version += 1
        if mount not in self._mounts:
            self._mounts[mount] = _Mount(PeakWindow(self.peak_window))
        return self._mounts[mount]

    def record_polled(self, usages: Iterable[MountUsage]) -> None:
        """One poll's mounts. Another instance at a path (remounted, or gone in between) starts
        its peak and high-water mark afresh: the old mount's say nothing of the new one's size."""
        now = self.clock()
        with self._lock:
            for u in usages:
                record = self._of(u.mount)
                # None with no error: the mount table could not say which (proves nothing).
                instance = u.instance or (GONE if u.error else None)
                if instance and record.instance and instance != record.instance:
                    record.peak, record.max_used = PeakWindow(self.peak_window), None
                record.instance = instance or record.instance
                record.live = not u.error
                if record.live:
                    self._used(record, u.used_bytes, now)

    def record_used(self, mount: str, used_bytes: int) -> None:
        """The watcher's statvfs after an event; a mount the last poll found gone takes none
        (it would measure the disk beneath)."""
        now = self.clock()
        with self._lock:
            if mount in self._mounts and not self._mounts[mount].live:
                return
            self._used(self._of(mount), used_bytes, now)

    def _used(self, record: _Mount, used_bytes: int, now: float) -> None:
        record.peak.add(now, used_bytes)
        if record.max_used is None or used_bytes > record.max_used.used_bytes:
            record.max_used = HighWaterMark(used_bytes=used_bytes, at=self.wall_clock())

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
                peaks={m: p for m, r in mounts if (p := r.peak.peak(now)) is not None},
                max_used={m: r.max_used for m, r in mounts if r.max_used is not None},
                event_rows={
                    m: tuple(sorted((*k, n) for k, n in r.events.items()))
                    for m, r in mounts
                    if r.events
                },
                inotify={m: r.inotify for m, r in mounts if r.inotify is not None},
                overflows={m: r.overflows for m, r in mounts if r.overflows},
            )
