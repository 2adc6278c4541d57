"""One watchdog InotifyFD, not its Observer (a thread a watch); an event takes a statvfs
at once, so peaks keep a 2 s spike between scrapes. Unwatchable: polled, said once."""

import contextlib
import errno
import logging
import os
import threading
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from exporter.host.mountinfo import live_mounts
from exporter.host.paths import Paths
from exporter.host.said import SaidOnce
from exporter.inventory.changes import ChangeLog
from exporter.model.classes import classify
from exporter.model.state import StateStore
from exporter.model.types import MountSet, Observation

log = logging.getLogger(__name__)

# No IN_OPEN/IN_CLOSE: our listings cause them (a loop); a create-and-close is then one
# event, not three: 10,000 creates fit the default 16,384-event queue. Not recursive.
IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_ISDIR = 0x100, 0x200, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000
CREATED, DELETED = IN_CREATE | IN_MOVED_TO, IN_DELETE | IN_MOVED_FROM
WATCH_MASK = CREATED | DELETED | IN_MODIFY | IN_ATTRIB | IN_ONLYDIR | IN_DONT_FOLLOW
CALLBACK_ID = 0  # one callback per watch: ours


def _inotify():  # its reading thread not started
    from watchdog.observers.inotify_c import InotifyFD  # ImportError off Linux

    reader = InotifyFD()
    reader.name = "shmwatch-inotify"
    return reader


def _close(reader) -> None:
    if reader is None:
        return
    with contextlib.suppress(Exception):
        reader.stop()
        reader.join(1.0)
        # watchdog 7.1 closes the fd in its read loop, so one stopped before its thread first
        # read keeps it (closed and reading: the loop never cleared the flag, nor closed).
        if reader._closed and reader._is_reading and not reader.is_alive():
            reader._close_resources()


class MountWatcher:
    def __init__(
        self,
        state: StateStore,
        paths: Paths,
        mounts: "Sequence[str] | Callable[[], List[str]]",
        wake: Callable[..., None] = lambda full=False: None,
        enabled: bool = True,
        inotify_factory: Callable[[], object] = _inotify,
        changes: Optional[ChangeLog] = None,
    ):
        self.state, self.paths, self.wake = state, paths, wake
        self._mounts = live_mounts(mounts)  # discovery's current mounts
        self.enabled, self.inotify_factory = enabled, inotify_factory
        self.changes = changes or ChangeLog()  # names for the next quick inventory
        self.inotify = None  # watchdog's InotifyFD, once started
        self._stopped = False  # for good: a refresh after stop() must not start inotify
        self.watches: Dict[str, Tuple[int, int]] = {}  # mount -> (wd, st_dev watched)
        # wd -> its mounts: two paths to one directory (a bind mount) are one inotify watch.
        self._mounts_on: Dict[int, Tuple[str, ...]] = {}
        self._said = SaidOnce(log)
        self._lock = threading.Lock()
        self._previous: Dict[str, object] = {}  # each mount's last inventory
        self._settled: Optional[MountSet] = None  # the last set left wholly watched

    def stop(self) -> None:  # for good: discovery, stopped after us, may still publish
        with self._lock:
            self._stopped = True
            reader, self.inotify = self.inotify, None
        _close(reader)

    def _watch(self, mount: str) -> None:
        path = os.fsencode(self.paths.host(mount))
        if (reader := self.inotify) is None:  # read once: stop() may clear it meanwhile
            return
        try:
            dev = os.stat(self.paths.host(mount)).st_dev  # str: errors name the path
            with warnings.catch_warnings():
                # A bind mount re-adds one watch; watchdog warns it "overwrites"
                warnings.simplefilter("ignore", RuntimeWarning)
                wd = reader.add_callback(path, WATCH_MASK, self, CALLBACK_ID)
            if wd < 0:  # InotifyFD does not raise EACCES
                reader.remove_callbacks([(wd, CALLBACK_ID)])
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        except Exception as err:  # OSError: ENOSPC (max_user_watches), ENOENT, ENOTDIR
            self.state.set_inotify(mount, False)
            self._said.say(mount, f"cannot watch with inotify ({err}): polling")
            return
        with self._lock:
            self.watches[mount] = (wd, dev)
            self._mounts_on[wd] = (*self._mounts_on.get(wd, ()), mount)
            self.state.set_inotify(mount, True)  # under the lock, as on_watch_deleted
        self._said.say(mount, "inotify on", logging.INFO)

    def refresh(self) -> None:
        """Watch missing mounts, re-watch one mounted again (another device), forget gone ones."""
        if self._stopped:
            return
        current = set(self._mounts())
        self.state.forget_mounts_except(current)
        for mount in self.watches.keys() - current:
            self._unwatch(mount)
        with self._lock:
            self._said.keep(current)
            self._previous = {m: i for m, i in self._previous.items() if m in current}
        if (reader := self.inotify) is not None and not reader.is_alive():
            log.warning("the inotify reader stopped: watching every mount anew")
            for wd in list(self._mounts_on):  # as if the kernel had dropped every watch
                self.on_watch_deleted(wd)
            self.inotify = None
            _close(reader)
        said = None if self.enabled else "inotify disabled (--no-inotify): polling"
        if self.inotify is None and self.enabled:
            try:
                reader = self.inotify_factory()
                reader.start()
            except Exception as err:  # ImportError off Linux, EMFILE (instances)
                said = f"inotify unavailable ({err}): polling every inventory interval"
            else:
                with self._lock:  # a stop() landing meanwhile closes it, or none starts
                    if not self._stopped:
                        self.inotify, reader = reader, None
                _close(reader)
        if self.inotify is None:  # polling; retried each refresh (limits can rise live)
            for mount in current:
                self.state.set_inotify(mount, False)
                if said:
                    self._said.say(mount, said)
            return
        for mount in sorted(current):
            watched = self.watches.get(mount)
            if watched is not None:
                with contextlib.suppress(OSError):
                    if os.stat(self.paths.host(mount)).st_dev == watched[1]:
                        continue
                self._unwatch(mount)  # unmounted, or mounted again
            self._watch(mount)

    start = refresh  # the first refresh starts inotify

    def _unwatch(self, mount: str) -> None:
        with self._lock:
            wd, _ = self.watches.pop(mount, (None, None))
            others = tuple(m for m in self._mounts_on.pop(wd, ()) if m != mount)
            if others:
                self._mounts_on[wd] = others  # the watch stays theirs
        if wd is not None and not others and self.inotify is not None:
            with contextlib.suppress(Exception):  # gone with its mount, perhaps
                self.inotify.remove_callbacks([(wd, CALLBACK_ID)])

    def on_event(self, event) -> None:  # on the inotify thread, as the three below
        if not event.name:
            return  # the directory itself (its attributes, unmounted)
        name, mask = os.fsdecode(event.name), event.mask
        kind = "created" if mask & CREATED else "deleted" if mask & DELETED else None
        for mount in self._mounts_on.get(event.wd, ()):
            try:
                if mask & IN_ISDIR:  # what is below a new directory: re-listed
                    self.changes.unknown(mount)
                else:
                    self.changes.add(mount, name)
                    if kind:
                        self.state.count_event(mount, classify(name), kind)
                self.state.touch(mount)
                with contextlib.suppress(OSError):  # the poll reports the mount's error
                    st = os.statvfs(self.paths.host(mount))
                    used = (st.f_blocks - st.f_bfree) * st.f_frsize
                    self.state.record_used([(mount, used)])
                self.wake()
            except Exception:  # would end the thread that reads every mount's events
                log.exception("mount %s: handling an inotify event failed", mount)

    def on_watch_deleted(self, wd: int) -> None:
        """The kernel dropped a watch (unmounted, directory deleted): polled until a refresh."""
        with self._lock:
            self._settled = None
            for mount in self._mounts_on.pop(wd, ()):
                self.watches.pop(mount, None)
                if self.inotify is not None:  # not stopping
                    self.state.set_inotify(mount, False)

    def on_queue_overflow(self) -> None:
        """Lost events (one queue serves every mount): counted on each, each re-listed at once."""
        with self._lock:
            watched = list(self.watches)
        for mount in watched:
            self.state.count_overflow(mount)
            self.changes.unknown(mount)
        log.warning(
            "inotify queue overflowed: events were lost on %d mount(s); running a full inventory",
            len(watched),
        )
        self.wake(full=True)

    def on_events_lost(self) -> None:  # watchdog >= 7.1: after on_queue_overflow
        pass

    def on_mounts(self, mount_set: MountSet) -> None:
        """Every discovery poll; a refresh stats every mount, so only for a new set (the table
        changed), or while a mount or the reader is not watching."""
        reader = self.inotify
        if mount_set is self._settled and (reader is None or reader.is_alive()):
            return
        self.refresh()
        with self._lock:  # a watch the kernel dropped meanwhile unsettles it (above)
            wanted = set(mount_set.mounts())
            watched = self.inotify is not None and wanted <= self.watches.keys()
            self._settled = mount_set if watched or not self.enabled else None

    def on_observation(self, obs: Observation) -> None:
        """On polled mounts created/deleted come from the inventory's listings (a quick run
        hands an untouched mount's inventory back: counted once)."""
        if obs.source != "segments" or not obs.success:
            return
        with self._lock:  # refresh() forgets gone mounts from the discovery thread
            new = [m for m in obs.result.mounts if self._previous.get(m.mount) is not m]
            self._previous.update((m.mount, m) for m in new)
        for m in new:
            if not m.error and not self.state.inotify_active(m.mount):
                for (cls, event), n in m.events.items():
                    self.state.count_event(m.mount, cls, event, n)
