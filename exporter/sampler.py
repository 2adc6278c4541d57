"""The sampler: runs each collector on its own thread and keeps the latest snapshot.

One thread per collector, so a slow or hung source (a GPU fallen off the bus, a stuck
mount) never delays the others; a run that overruns its timeout is reported failed at
scrape time, and its thread is not replaced while it is still stuck. Scrapes only read
what is kept here: they never touch /proc, /sys or NVML.

inotify events (events.py) wake the segment inventory early, debounced, and feed the
peak window with a statvfs taken at the moment of the event.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

# How long the inventory waits for an inotify burst to settle before re-scanning, and
# how far it may be pushed back by a burst that never settles.
DEBOUNCE_SECONDS = 0.02
DEBOUNCE_MAX_SECONDS = 0.1
# An event-driven re-scan costs its duration again in idle time at least this many
# times over, so a storm of creates costs a bounded share of a core.
QUICK_SCAN_DUTY_FACTOR = 4.0
# After a burst, a full inventory (owners from /proc) follows this soon.
FOLLOW_UP_SECONDS = 1.0


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


@dataclass
class CollectorState:
    name: str
    result: object = None
    success: bool = False
    duration: float = 0.0
    error: Optional[str] = None
    running_since: Optional[float] = None
    runs: int = 0


@dataclass
class Snapshot:
    """What a scrape renders: copies, taken under the sampler's lock."""
    states: Dict[str, CollectorState]
    peaks: Dict[str, int]
    events: Dict[Tuple[str, str, str], int]
    inotify: Dict[str, bool]


class _Runner(threading.Thread):
    def __init__(self, sampler: "Sampler", collector, interval: float, timeout: float):
        super().__init__(name=f"shmwatch-{collector.name}", daemon=True)
        self.sampler = sampler
        self.collector = collector
        self.interval = interval
        self.timeout = timeout
        self.wake = threading.Event()
        self.quick_pending = False
        self.first_event_at: Optional[float] = None
        self.follow_up_at: Optional[float] = None
        self.next_quick_at = 0.0

    def request_quick(self) -> None:
        if self.first_event_at is None:
            self.first_event_at = time.monotonic()
        self.quick_pending = True
        self.wake.set()

    def run(self) -> None:
        stop = self.sampler.stopping
        next_full = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_full:
                self._run_once(full=True)
                next_full = max(next_full + self.interval, time.monotonic())
                self.follow_up_at = None
                continue
            if self.quick_pending:
                # Debounce: run once the burst has been quiet for DEBOUNCE_SECONDS, or
                # DEBOUNCE_MAX_SECONDS after its first event, whichever comes first.
                first = self.first_event_at or now
                while not stop.is_set():
                    self.wake.clear()
                    left = first + DEBOUNCE_MAX_SECONDS - time.monotonic()
                    if left <= 0 or not self.wake.wait(min(DEBOUNCE_SECONDS, left)):
                        break
                wait_more = self.next_quick_at - time.monotonic()
                if wait_more > 0:
                    stop.wait(wait_more)
                # This order loses no event: one that lands in between leaves
                # quick_pending set (first_event_at None is handled above).
                self.quick_pending = False
                self.first_event_at = None
                started = time.monotonic()
                self._run_once(full=False)
                spent = time.monotonic() - started
                self.next_quick_at = time.monotonic() + spent * QUICK_SCAN_DUTY_FACTOR
                self.follow_up_at = time.monotonic() + FOLLOW_UP_SECONDS
                continue
            if self.follow_up_at is not None and now >= self.follow_up_at:
                next_full = now
                continue
            deadline = min(next_full, self.follow_up_at or next_full)
            self.wake.wait(max(0.0, deadline - now))
            self.wake.clear()

    def _run_once(self, full: bool) -> None:
        name = self.collector.name
        sampler = self.sampler
        started = time.monotonic()
        with sampler.lock:
            sampler.states[name].running_since = started
        try:
            if full or not hasattr(self.collector, "collect_quick"):
                result = self.collector.collect()
            else:
                result = self.collector.collect_quick()
            error = None
        except Exception as err:  # one source failing must not stop the others
            result, error = None, f"{type(err).__name__}: {err}"
        duration = time.monotonic() - started
        sampler._store(name, result, error, duration)


class Sampler:
    def __init__(self, collectors: Sequence, poll_interval: float = 1.0, inventory_interval: float = 15.0,
                 peak_window: float = 60.0, timeouts: Optional[Dict[str, float]] = None,
                 default_timeout: float = 10.0):
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.collectors = {c.name: c for c in collectors}
        self.states: Dict[str, CollectorState] = {c.name: CollectorState(c.name) for c in collectors}
        self.peak_window = peak_window
        self.peaks: Dict[str, PeakWindow] = {}
        self.events: Dict[Tuple[str, str, str], int] = {}
        self.inotify: Dict[str, bool] = {}
        self._logged_errors: Dict[str, Optional[str]] = {}
        self.listeners: List[Callable[[str, object], None]] = []
        timeouts = timeouts or {}
        self.runners: Dict[str, _Runner] = {}
        for c in collectors:
            interval = inventory_interval if c.schedule == "inventory" else poll_interval
            self.runners[c.name] = _Runner(self, c, interval, timeouts.get(c.name, default_timeout))

    # --- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        for runner in self.runners.values():
            runner.start()

    def stop(self, timeout: float = 1.0) -> None:
        self.stopping.set()
        for runner in self.runners.values():
            runner.wake.set()
        deadline = time.monotonic() + timeout
        for runner in self.runners.values():
            if runner.is_alive():
                runner.join(max(0.0, deadline - time.monotonic()))

    def run_once(self) -> None:
        """Run every collector once, in this thread (for `shmwatch check` and tests)."""
        for runner in self.runners.values():
            runner._run_once(full=True)

    def wait_for_first_run(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if all(s.runs for s in self.states.values()):
                    return True
            time.sleep(0.01)
        return False

    # --- results --------------------------------------------------------------------
    def _store(self, name: str, result: object, error: Optional[str], duration: float) -> None:
        with self.lock:
            state = self.states[name]
            state.result, state.error, state.duration = result, error, duration
            state.success = error is None
            state.running_since = None
            state.runs += 1
        self._log_change(name, error)
        if error is None:
            for listener in self.listeners:
                listener(name, result)

    def _log_change(self, name: str, error: Optional[str]) -> None:
        # Log when a collector starts failing or recovers, not on every tick.
        previous = self._logged_errors.get(name)
        if error != previous:
            if error:
                log.error("collector %s failed: %s", name, error)
            elif previous:
                log.info("collector %s recovered", name)
            self._logged_errors[name] = error

    def record_used(self, mount: str, used_bytes: int, now: Optional[float] = None) -> None:
        with self.lock:
            window = self.peaks.get(mount)
            if window is None:
                window = self.peaks[mount] = PeakWindow(self.peak_window)
            window.add(time.monotonic() if now is None else now, used_bytes)

    def count_event(self, mount: str, segment_class: str, event: str, n: int = 1) -> None:
        key = (mount, segment_class, event)
        with self.lock:
            self.events[key] = self.events.get(key, 0) + n

    def forget_mounts_except(self, mounts) -> None:
        """A mount that went away (a pod deleted) takes its peaks, counters and flags with it."""
        with self.lock:
            for mount in [m for m in self.peaks if m not in mounts]:
                del self.peaks[mount]
            for key in [k for k in self.events if k[0] not in mounts]:
                del self.events[key]
            for mount in [m for m in self.inotify if m not in mounts]:
                del self.inotify[mount]

    def set_inotify(self, mount: str, active: bool) -> None:
        with self.lock:
            self.inotify[mount] = active

    def request_inventory(self) -> None:
        """An inotify event: re-measure the mounts and re-list their segments soon (debounced)."""
        for runner in self.runners.values():
            if runner.collector.schedule == "inventory" or runner.collector.name == "shm_mount":
                runner.request_quick()

    def snapshot(self) -> Snapshot:
        now = time.monotonic()
        with self.lock:
            states = {}
            for name, state in self.states.items():
                copy = CollectorState(**vars(state))
                timeout = self.runners[name].timeout
                if state.running_since is not None and now - state.running_since > timeout:
                    # Hung: its last result is stale, and the run has failed.
                    copy.success, copy.result = False, None
                    copy.error = f"timed out after {timeout:g}s"
                    copy.duration = now - state.running_since
                states[name] = copy
            peaks = {m: p for m, w in self.peaks.items() if (p := w.peak(now)) is not None}
            snap = Snapshot(states, peaks, dict(self.events), dict(self.inotify))
        for name, state in states.items():
            if state.error and state.error.startswith("timed out"):
                self._log_change(name, state.error)
        return snap
