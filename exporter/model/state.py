"""What outlives one observation: per-mount peaks, high-water marks, event counters and
inotify flags, and the OOM kills counted since start.

Fed by the model step (polls, the kernel log) and by the inotify watcher, read by the
model step. One lock, a small API; nobody reaches into its dictionaries. `version` moves
with every change; nobody is called back.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple

# How many OOM kills `shmwatch check` and the model remember (the newest).
RECENT_OOM_KILLS = 50


class PeakWindow:
    """Sliding-window maximum (monotonic deque): O(1) amortised per sample."""

    def __init__(self, window: float):
        self.window = window
        self._samples: Deque[Tuple[float, int]] = deque()

    def add(self, now: float, value: int) -> None:
        while self._samples and self._samples[-1][1] <= value:
            self._samples.pop()
        self._samples.append((now, value))
        self._expire(now)

    def _expire(self, now: float) -> None:
        while len(self._samples) > 1 and self._samples[0][0] < now - self.window:
            self._samples.popleft()

    def peak(self, now: float) -> Optional[int]:
        self._expire(now)
        if not self._samples:
            return None
        if self._samples[0][0] < now - self.window:
            # Only an old sample is left: it is still the latest value we know.
            return self._samples[-1][1]
        return self._samples[0][1]


@dataclass(frozen=True)
class MountStates:
    """A copy of the store, for one model step."""

    peaks: Dict[str, int]
    # mount -> (highest used bytes since first seen, wall clock)
    max_used: Dict[str, Tuple[int, float]]
    # mount -> its ((class, event, count), ...) sorted: the same tuple while its counts stand,
    # so a render's memo of a mount's counter lines can key on it.
    event_rows: Dict[str, Tuple[Tuple[str, str, int], ...]]
    inotify: Dict[str, bool]
    overflows: Dict[str, int]  # mount -> inotify queue overflows while it was watched
    # OOM kills: cgroup (a pod's in node mode, else the victim's) -> kills in the kernel log
    # since start; cgroup -> the highest count its own counter showed; the newest kills,
    # each with its pod's shm use when it was seen (None: not known).
    oom_kills: Dict[str, int] = field(default_factory=dict)
    oom_cgroup_max: Dict[str, int] = field(default_factory=dict)
    recent_oom_kills: Tuple[Tuple[object, Optional[int]], ...] = ()

    @property
    def events(self) -> Dict[Tuple[str, str, str], int]:
        """(mount, class, event) -> count, made when asked."""
        return {
            (mount, cls, event): n
            for mount, rows in self.event_rows.items()
            for cls, event, n in rows
        }


class StateStore:
    def __init__(
        self,
        peak_window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.peak_window = peak_window
        self.clock = clock
        self.wall_clock = wall_clock  # the high-water mark's timestamp is for humans and PromQL's time()
        self._lock = threading.Lock()
        self._peaks: Dict[str, PeakWindow] = {}
        self._max_used: Dict[str, Tuple[int, float]] = {}
        self._events_of: Dict[
            str, Dict[Tuple[str, str], int]
        ] = {}  # mount -> (class, event) -> count
        self._event_rows: Dict[
            str, Tuple[Tuple[str, str, int], ...]
        ] = {}  # by snapshot()
        self._inotify: Dict[str, bool] = {}
        self._overflows: Dict[str, int] = {}
        # Bumped when a watch starts and when its queue overflows: inotify saw everything
        # in a mount between two looks only if the epoch is the same at both.
        self._watch_epochs: Dict[str, int] = {}
        self._epoch = 0  # one counter for all: a mount seen again never repeats one
        self._oom: Dict[str, int] = {}
        self._oom_cgroup: Dict[str, int] = {}
        self._recent_oom: Deque[Tuple[object, Optional[int]]] = deque(
            maxlen=RECENT_OOM_KILLS
        )
        self._touched: Set[str] = (
            set()
        )  # mounts inotify saw change, for the next quick statvfs
        self._version = 0

    def version(self) -> int:
        """Moves with every change to what snapshot() returns (peaks also age out)."""
        return self._version

    def touch(self, mount: str) -> None:
        """inotify saw `mount` change (the watcher); drained by shm_mount's next run."""
        with self._lock:
            self._touched.add(mount)

    def drain_touched(self) -> Set[str]:
        with self._lock:
            touched, self._touched = self._touched, set()
        return touched

    def record_used(self, mount: str, used_bytes: int) -> None:
        self.record_used_many([(mount, used_bytes)])

    def record_used_many(self, usages: "List[Tuple[str, int]]") -> None:
        """One poll's mounts under one lock (a node polls 200 a second)."""
        now = self.clock()
        with self._lock:
            for mount, used_bytes in usages:
                window = self._peaks.get(mount)
                if window is None:
                    window = self._peaks[mount] = PeakWindow(self.peak_window)
                window.add(now, used_bytes)
                # The high-water mark keeps the first time the highest value was reached.
                if mount not in self._max_used or used_bytes > self._max_used[mount][0]:
                    self._max_used[mount] = (used_bytes, self.wall_clock())
            self._version += bool(usages)

    def count_event(
        self, mount: str, segment_class: str, event: str, n: int = 1
    ) -> None:
        key = (segment_class, event)
        with self._lock:
            of_mount = self._events_of.setdefault(mount, {})
            of_mount[key] = of_mount.get(key, 0) + n
            self._event_rows.pop(mount, None)
            self._version += 1

    def count_overflow(self, mount: str) -> None:
        with self._lock:
            self._overflows[mount] = self._overflows.get(mount, 0) + 1
            self._epoch += 1
            self._watch_epochs[mount] = self._epoch
            self._version += 1

    def count_oom_kill(
        self, cgroup: str, kill: object, shm_used: Optional[int]
    ) -> None:
        """One kill from the kernel log, counted under `cgroup` for good: it outlives the
        victim's cgroup (and a pod's mounts), so it is never forgotten with them."""
        with self._lock:
            self._oom[cgroup] = self._oom.get(cgroup, 0) + 1
            self._recent_oom.append((kill, shm_used))
            self._version += 1

    def record_cgroup_oom(self, cgroup: str, count: int) -> None:
        """A cgroup's own counter: kept as the highest value seen, so it never goes down."""
        with self._lock:
            if count <= self._oom_cgroup.get(cgroup, -1):
                return
            self._oom_cgroup[cgroup] = count
            self._version += 1

    def set_inotify(self, mount: str, active: bool) -> None:
        with self._lock:
            if self._inotify.get(mount) == active:
                return
            self._inotify[mount] = active
            if active:
                self._epoch += 1
                self._watch_epochs[mount] = self._epoch
            self._version += 1

    def watch_epoch(self, mount: str) -> Optional[int]:
        """None while inotify does not watch the mount; otherwise a number that moves when the
        watch (re)starts or its queue overflows: events may have been lost in between."""
        with self._lock:
            return (
                self._watch_epochs.get(mount, 0) if self._inotify.get(mount) else None
            )

    def inotify_active(self, mount: str) -> bool:
        with self._lock:
            return self._inotify.get(mount, False)

    def known_inotify(self) -> Iterable[str]:
        with self._lock:
            return list(self._inotify)

    def forget_mounts_except(self, mounts: Iterable[str]) -> None:
        """A mount that went away (a pod deleted) takes its peaks, counters and flags with it."""
        keep = set(mounts)
        with self._lock:
            for books in (
                self._peaks,
                self._max_used,
                self._events_of,
                self._event_rows,
                self._inotify,
                self._overflows,
                self._watch_epochs,
            ):
                for mount in [m for m in books if m not in keep]:
                    del books[mount]
                    self._version += 1

    def snapshot(self) -> MountStates:
        now = self.clock()
        with self._lock:
            peaks = {
                m: p for m, w in self._peaks.items() if (p := w.peak(now)) is not None
            }
            rows = self._event_rows
            for mount, counts in self._events_of.items():
                if mount not in rows:
                    rows[mount] = tuple(
                        sorted((cls, event, n) for (cls, event), n in counts.items())
                    )
            return MountStates(
                peaks,
                dict(self._max_used),
                dict(rows),
                dict(self._inotify),
                dict(self._overflows),
                dict(self._oom),
                dict(self._oom_cgroup),
                tuple(self._recent_oom),
            )
