"""React within a second: inotify (through watchdog) on every monitored mount.

Prometheus scrapes every 15-60 s; NCCL allocates its segments and crashes in less.
On each create/grow/delete we take a statvfs at once (it feeds the peak window, so a
2 s spike stays on the graph) and wake the segment inventory, which debounces bursts.

Where inotify cannot be had (no support, fs.inotify.max_user_instances or
max_user_watches exhausted) the mount is polled instead, said once in the log, and
shmwatch_inotify_active{mount} is 0; created/deleted then come from inventory diffs.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .discovery import MountSet, live_mounts
from .inventory.changes import ChangeLog
from .paths import Paths
from .sampler import Observation
from .segment_classes import classify
from .state import StateStore

log = logging.getLogger(__name__)

# Only what changes a mount's contents. opened / closed_no_write are left out: our own
# directory listings cause them, and reacting to them would loop.
RELEVANT = ("created", "deleted", "modified", "moved")


def _event_filter():
    # Ask the kernel only for what we count (IN_CREATE, IN_DELETE, IN_MOVED_*, IN_MODIFY,
    # IN_ATTRIB): no IN_OPEN/IN_CLOSE. A create-and-close is then one queued event, not
    # three, so a storm of 10,000 creates fits the default 16,384-event queue.
    from watchdog.events import FileCreatedEvent, FileDeletedEvent, FileModifiedEvent, FileMovedEvent
    return [FileCreatedEvent, FileDeletedEvent, FileModifiedEvent, FileMovedEvent]


# watchdog (>= 7) shares one inotify instance between all watches and, on IN_Q_OVERFLOW,
# drops its pending events and says so in its log only (observers/inotify_c.py: "Inotify
# queue overflowed; filesystem events were lost"): that record is our signal.
WATCHDOG_INOTIFY_LOGGER = "watchdog.observers.inotify_c"


class _OverflowSignal(logging.Handler):
    def __init__(self, watcher: "MountWatcher"):
        super().__init__(logging.WARNING)
        self.watcher = watcher

    def emit(self, record: logging.LogRecord) -> None:
        if "queue overflow" in record.getMessage().lower():
            self.watcher.on_overflow()


def _make_handler(watcher: "MountWatcher", mount: str):
    from watchdog.events import FileSystemEventHandler

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event) -> None:
            if event.event_type not in RELEVANT:
                return
            watcher.on_event(mount, event)

    return Handler()


class MountWatcher:
    """Watches the mounts discovery publishes. Talks to the state store (peaks, counters,
    inotify flags), to the change log (names for the next quick inventory) and to
    `wake` (the sampler's request for an event-driven run)."""

    def __init__(self, state: StateStore, paths: Paths, mounts: "Sequence[str] | Callable[[], List[str]]",
                 wake: Callable[[], None] = lambda: None, enabled: bool = True,
                 statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
                 observer_factory: Optional[Callable[[], object]] = None, changes: Optional[ChangeLog] = None,
                 wake_full: Callable[[], None] = lambda: None):
        self.state = state
        self.wake = wake
        self.wake_full = wake_full
        self._overflow_signal = _OverflowSignal(self)
        self.paths = paths
        self._mounts = live_mounts(mounts)  # discovery's current mounts
        self.enabled = enabled
        self.statvfs = statvfs
        self.observer_factory = observer_factory
        self.changes = changes  # segments.ChangeLog: names for the next quick inventory
        self.observer = None
        self._started = False
        self._last_set: Optional[MountSet] = None  # what discovery published last (on_mounts)
        self.watches: Dict[str, Tuple[object, int]] = {}  # mount -> (watch, st_dev watched)
        self._said: Dict[str, str] = {}
        self._lock = threading.Lock()
        # Inventory diffs, for mounts that are polled.
        self._previous: Dict[str, Dict[Tuple[int, int], str]] = {}  # mount -> listed inode -> class

    # --- set-up -----------------------------------------------------------------------
    @property
    def mounts(self):
        return self._mounts()

    def start(self) -> None:
        self._started = True
        inotify_log = logging.getLogger(WATCHDOG_INOTIFY_LOGGER)
        inotify_log.addHandler(self._overflow_signal)
        if inotify_log.getEffectiveLevel() > logging.WARNING:
            inotify_log.setLevel(logging.WARNING)  # --log.level=error must not hide the signal from us
        for mount in self.mounts:
            self.state.set_inotify(mount, False)
        if not self.enabled:
            for mount in self.mounts:
                self._say(mount, "inotify disabled (--no-inotify): polling")
            return
        if self._start_observer():
            for mount in self.mounts:
                self._watch(mount)

    def _start_observer(self) -> bool:
        try:
            if self.observer_factory is not None:
                observer = self.observer_factory()
            else:
                from watchdog.observers.inotify import InotifyObserver
                observer = InotifyObserver()
            observer.daemon = True
            observer.start()
        except Exception as err:  # ImportError off Linux, OSError from inotify_init (EMFILE: instances)
            for mount in self.mounts:
                self._say(mount, f"inotify unavailable ({err}): polling every inventory interval")
            return False
        self.observer = observer
        return True

    def stop(self) -> None:
        logging.getLogger(WATCHDOG_INOTIFY_LOGGER).removeHandler(self._overflow_signal)
        if self.observer is not None:
            try:
                self.observer.stop()
                self.observer.join(1.0)
            except Exception:
                pass

    def _say(self, mount: str, message: str) -> None:
        if self._said.get(mount) != message:
            self._said[mount] = message
            (log.info if "inotify on" in message else log.warning)("mount %s: %s", mount, message)

    def _watch(self, mount: str) -> None:
        path = self.paths.host(mount)
        try:
            dev = os.stat(path).st_dev
            watch = self.observer.schedule(_make_handler(self, mount), path, recursive=False,
                                           event_filter=_event_filter())
        except Exception as err:  # OSError: ENOSPC (max_user_watches), EMFILE (instances), ENOENT
            self.state.set_inotify(mount, False)
            self._say(mount, f"cannot watch with inotify ({err}): polling")
            return
        with self._lock:
            self.watches[mount] = (watch, dev)
        self.state.set_inotify(mount, True)
        self._say(mount, "inotify on")

    def refresh(self, recheck_watched: bool = True) -> None:
        """Re-watch a mount that was missing, or (`recheck_watched`) was unmounted and mounted
        again; forget gone ones."""
        current = set(self.mounts)
        self.state.forget_mounts_except(current)
        for mount in list(self.watches):
            if mount not in current:
                watch, _ = self.watches.pop(mount)
                try:
                    self.observer.unschedule(watch)
                except Exception:
                    pass
        with self._lock:
            for gone in [m for m in self._previous if m not in current]:
                del self._previous[gone]
            for gone in [m for m in self._said if m not in current]:
                del self._said[gone]  # node mode: pods come and go; their log state goes with them
        if self.observer is None and not (self.enabled and self._start_observer()):
            # Polling; inotify is tried again on the next refresh (limits can be raised live).
            for mount in current - set(self.state.known_inotify()):
                self.state.set_inotify(mount, False)
            return
        alive = self.observer.is_alive()
        for mount in sorted(current):
            watched = self.watches.get(mount)
            if watched is not None and not recheck_watched and alive:
                continue
            try:
                dev = os.stat(self.paths.host(mount)).st_dev
            except OSError:
                dev = None
            if watched is not None and watched[1] == dev and alive:
                continue
            if watched is not None:
                try:
                    self.observer.unschedule(watched[0])
                except Exception:
                    pass
                with self._lock:
                    self.watches.pop(mount, None)
                self.state.set_inotify(mount, False)
            if dev is not None:
                self._watch(mount)

    # --- events -------------------------------------------------------------------------
    def on_event(self, mount: str, event) -> None:
        kind = event.event_type
        if self.changes is not None:
            root = self.paths.host(mount)
            for path in (event.src_path, getattr(event, "dest_path", "") or ""):
                if not path or os.path.normpath(path) == os.path.normpath(root):
                    continue
                if event.is_directory:
                    self.changes.unknown(mount)  # what is below a new directory: re-list
                else:
                    self.changes.add(mount, os.path.basename(path))
        if not event.is_directory:
            if kind in ("created", "deleted"):
                self.state.count_event(mount, classify(os.path.basename(event.src_path)), kind)
            elif kind == "moved":
                self.state.count_event(mount, classify(os.path.basename(event.src_path)), "deleted")
                self.state.count_event(mount, classify(os.path.basename(event.dest_path)), "created")
        self.state.touch(mount)
        try:
            st = self.statvfs(self.paths.host(mount))
            self.state.record_used(mount, (st.f_blocks - st.f_bfree) * st.f_frsize)
        except OSError:
            pass  # the poll will report the mount's error
        self.wake()

    def on_overflow(self) -> None:
        """The kernel dropped events: count it on every watched mount (one queue serves them
        all), and re-list every mount at once instead of patching what the events said."""
        with self._lock:
            watched = list(self.watches)
        for mount in watched:
            self.state.count_overflow(mount)
            if self.changes is not None:
                self.changes.unknown(mount)
        log.warning("inotify queue overflowed: events were lost on %d mount(s); running a full inventory",
                    len(watched))
        self.wake_full()

    def on_mounts(self, mount_set: MountSet) -> None:
        """Discovery subscriber: watch new mounts, re-watch remounted ones, forget gone ones.
        Node mode publishes every second; while the mount table has not changed, no watched
        mount can have been mounted again, and 200 stat()s a second are spared."""
        if self._started:
            unchanged = mount_set.follows_mount_table and mount_set is self._last_set
            self._last_set = mount_set
            self.refresh(recheck_watched=not unchanged)

    def on_observation(self, obs: Observation) -> None:
        """Sampler subscriber: on polled mounts, created/deleted come from inventory diffs."""
        if obs.source == "segments" and obs.success:
            self._diff(obs.result)

    def _diff(self, inv) -> None:
        for m in inv.mounts:
            if m.error:
                continue
            keys = {s.key: s.cls for s in m.segments if s.state != "hidden"}
            with self._lock:  # refresh() forgets gone mounts from the discovery thread
                previous = self._previous.get(m.mount)
                self._previous[m.mount] = keys
            if previous is not None and not self.state.inotify_active(m.mount):
                for key in keys.keys() - previous.keys():
                    self.state.count_event(m.mount, keys[key], "created")
                for key in previous.keys() - keys.keys():
                    self.state.count_event(m.mount, previous[key], "deleted")
