"""One inotify instance for every watched mount: watchdog's InotifyFD (a reading thread that
hands raw events to us), not its Observer (a thread per watch). An event counts, takes a
statvfs at once (so peaks keep a 2 s spike between scrapes) and asks the scheduler for a run
that is handed the name. A mount inotify cannot watch is polled, and said once.

Threads: `on_observation` (so `on_mounts` and `refresh`) runs on the thread that publishes
the observation (discovery's for a mount set, the segments source's for an inventory);
`on_event`, `on_watch_deleted`, `on_queue_overflow` on watchdog's (its dispatcher), `stop`
on the caller's. What they share (the watches) is under `_lock`."""

import contextlib
import errno
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Set
from typing import Tuple, cast

from exporter.host.paths import Paths
from exporter.host.said import SaidOnce, SaidRun
from exporter.model.classes import classify
from exporter.model.state import StateStore
from exporter.model.types import Inventory, MountInventory, MountSet, Observation

log = logging.getLogger(__name__)

# No IN_OPEN/IN_CLOSE: our listings cause them (a loop); a create-and-close is then one
# event, not three: 10,000 creates fit the default 16,384-event queue. Not recursive.
IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_ISDIR = 0x100, 0x200, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000
CREATED, DELETED = IN_CREATE | IN_MOVED_TO, IN_DELETE | IN_MOVED_FROM
WATCH_MASK = CREATED | DELETED | IN_MODIFY | IN_ATTRIB | IN_ONLYDIR | IN_DONT_FOLLOW
CALLBACK_ID = 0  # one callback per watch: ours
DISABLED = "inotify disabled (--no-inotify): polling"


class InotifyEvent(Protocol):
    """What we read of watchdog's InotifyEvent."""

    @property
    def wd(self) -> int: ...

    @property
    def mask(self) -> int: ...

    @property
    def name(self) -> bytes: ...


class InotifyReader(Protocol):
    """What we use of watchdog's InotifyFD: one inotify instance and its reading thread."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout: Optional[float] = None, /) -> None: ...

    def is_alive(self) -> bool: ...

    def add_callback(self, path: bytes, mask: int, callback: Any, id_: int, /) -> int:
        """The watch descriptor; negative when the kernel refused (EACCES)."""

    def remove_callbacks(self, callbacks: List[Tuple[int, int]], /) -> None: ...


class WatchOutlet(Protocol):
    """What the watcher tells the scheduler (runtime/scheduler.py's Sampler)."""

    def changed(self, mount: str, name: Optional[str]) -> None:
        """`name` changed in the mount's top directory; None: something below it."""

    def lost(self, mounts: Sequence[str]) -> None:
        """Events on these mounts were lost: each must be listed again, at once."""

    def watching(self, every_mount: bool) -> None:
        """Whether inotify watches every mount now."""


def _inotify() -> InotifyReader:
    """A new inotify instance, its reading thread not started."""
    from watchdog.observers.inotify_c import InotifyFD  # ImportError off Linux

    reader = InotifyFD()
    reader.name = "shmwatch-inotify"
    # watchdog types its descriptors and masks as NewTypes of int: the same ints.
    return cast(InotifyReader, reader)


def close_inotify(reader: Optional[InotifyReader]) -> None:
    """Stops the reader and closes its inotify fd, on the caller's thread.

    watchdog 7.1 closes the fd in its read loop, and says it is "reading" from its start: a
    reader stopped before its thread first read (or never started) is closed and "reading",
    and keeps its fd for good. This function alone reads those internals
    (tests/unit/runtime/test_watcher_close.py pins the behaviour it relies on)."""
    if reader is None:
        return
    with contextlib.suppress(Exception):
        reader.stop()
        if reader.is_alive():  # (one never started cannot be joined)
            reader.join(1.0)
        closed = getattr(reader, "_closed", False)
        reading = getattr(reader, "_is_reading", False)
        if closed and reading and not reader.is_alive():
            getattr(reader, "_close_resources")()


@dataclass(frozen=True)
class Watch:
    wd: int  # inotify's watch descriptor
    device: (
        int  # st_dev of the directory watched: another mount at the path has another
    )


class MountWatcher:
    def __init__(
        self,
        state: StateStore,
        paths: Paths,
        outlet: WatchOutlet,
        enabled: bool = True,
        inotify_factory: Callable[[], InotifyReader] = _inotify,
    ) -> None:
        self.state, self.paths, self.outlet = state, paths, outlet
        self.enabled, self.inotify_factory = enabled, inotify_factory
        self.inotify: Optional[InotifyReader] = None  # once started
        self._started = False  # discovery's mount sets are watched from start() on
        self._stopped = False  # for good: a refresh after stop() must not start inotify
        self.watches: Dict[str, Watch] = {}
        # wd -> its mounts: two paths to one directory (a bind mount) are one inotify watch.
        self._mounts_on: Dict[int, Tuple[str, ...]] = {}
        self._said = SaidOnce(log)
        self._lock = threading.Lock()
        self._current: Set[str] = (
            set()
        )  # the mounts to watch, as the last refresh was told
        self._previous: Dict[str, MountInventory] = {}  # each mount's last inventory
        self._settled: Optional[MountSet] = None  # the last set left wholly watched

    # --- what the scheduler publishes ------------------------------------------------------

    def on_observation(self, obs: Observation) -> None:
        """A scheduler subscriber: discovery's mount sets are watched; on a polled mount, the
        segments source's listings say what was created and deleted."""
        if obs.source == "discovery" and isinstance(obs.result, MountSet):
            self.on_mounts(obs.result)
        elif obs.source == "segments" and isinstance(obs.result, Inventory):
            self._count_polled_events(obs.result)

    def start(self) -> None:
        """From now on each mount set discovery publishes is watched (the first one starts
        inotify). Not started (`check`), nothing is."""
        self._started = True

    def on_mounts(self, mount_set: MountSet) -> None:
        """Every discovery poll; a refresh stats every mount, so only for a new set (the table
        changed), or while a mount or the reader is not watching."""
        if not self._started:
            return
        reader = self.inotify
        if mount_set is self._settled and (reader is None or reader.is_alive()):
            return
        self.refresh(mount_set.mounts())
        with self._lock:  # a watch the kernel dropped meanwhile unsettles it (below)
            wanted = set(mount_set.mounts())
            watched = self.inotify is not None and wanted <= self.watches.keys()
            self._settled = mount_set if watched or not self.enabled else None

    def _count_polled_events(self, inventory: Inventory) -> None:
        """On polled mounts created/deleted come from the inventory's listings (a quick run
        hands an untouched mount's inventory back: counted once)."""
        with self._lock:  # refresh() forgets gone mounts from discovery's thread
            new = [m for m in inventory.mounts if self._previous.get(m.mount) is not m]
            self._previous.update((m.mount, m) for m in new)
        for m in new:
            if not m.error and not self.state.inotify_active(m.mount):
                for (cls, event), n in m.events.items():
                    self.state.count_event(m.mount, cls, event, n)

    # --- watching --------------------------------------------------------------------------

    def refresh(self, mounts: Sequence[str]) -> None:
        """Watch these mounts: a missing one watched, one mounted again (another device)
        watched anew, a gone one forgotten; the first refresh starts inotify, which is
        retried each refresh while it cannot be had (limits can rise live)."""
        if self._stopped:
            return
        current = set(mounts)
        self._forget_all_but(current)
        said = self._said.run(current)
        self._replace_a_dead_reader()
        why_polled = self._start_inotify()
        if self.inotify is None:
            for mount in current:
                self.state.set_inotify(mount, False)
                if why_polled:
                    said.say(mount, why_polled)
        else:
            for mount in sorted(current):
                self._keep_watching(mount, said)
        self._tell_watching()

    def _forget_all_but(self, current: Set[str]) -> None:
        self.state.forget_mounts_except(current)
        for mount in self.watches.keys() - current:
            self._unwatch(mount)
        with self._lock:
            self._current = current
            self._previous = {m: i for m, i in self._previous.items() if m in current}

    def _replace_a_dead_reader(self) -> None:
        reader = self.inotify
        if reader is None or reader.is_alive():
            return
        log.warning("the inotify reader stopped: watching every mount anew")
        for wd in list(self._mounts_on):  # as if the kernel had dropped every watch
            self.on_watch_deleted(wd)
        self.inotify = None
        close_inotify(reader)

    def _start_inotify(self) -> Optional[str]:
        """-> why mounts are polled, or None: inotify is running (or was already)."""
        if not self.enabled:
            return DISABLED
        if self.inotify is not None:
            return None
        try:
            reader = self.inotify_factory()
        except Exception as err:  # ImportError off Linux, EMFILE (instances)
            return f"inotify unavailable ({err}): polling every inventory interval"
        try:
            reader.start()
        except Exception as err:  # no thread to be had
            close_inotify(reader)
            return f"inotify unavailable ({err}): polling every inventory interval"
        with self._lock:  # a stop() landing meanwhile closes it, or it is closed here
            kept = not self._stopped
            if kept:
                self.inotify = reader
        if not kept:
            close_inotify(reader)
        return None

    def _keep_watching(self, mount: str, said: SaidRun) -> None:
        """Watched already, on the same device: nothing to do; else (again) watched."""
        watched = self.watches.get(mount)
        if watched is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.paths.host(mount)).st_dev == watched.device:
                    return
            self._unwatch(mount)  # unmounted, or mounted again
        self._watch(mount, said)

    def _watch(self, mount: str, said: SaidRun) -> None:
        if (reader := self.inotify) is None:  # read once: stop() may clear it meanwhile
            return
        try:
            wd, dev = self._add_watch(reader, mount)
        except Exception as err:  # OSError: ENOSPC (max_user_watches), ENOENT, ENOTDIR
            self.state.set_inotify(mount, False)
            said.say(mount, f"cannot watch with inotify ({err}): polling")
            return
        with self._lock:
            self.watches[mount] = Watch(wd=wd, device=dev)
            self._mounts_on[wd] = (*self._mounts_on.get(wd, ()), mount)
            self.state.set_inotify(mount, True)  # under the lock, as on_watch_deleted
        said.say(mount, "inotify on", logging.INFO)

    def _add_watch(self, reader: InotifyReader, mount: str) -> Tuple[int, int]:
        """-> (watch descriptor, the directory's device)."""
        dev = os.stat(self.paths.host(mount)).st_dev  # str: errors name the path
        with warnings.catch_warnings():
            # A bind mount re-adds one watch; watchdog warns it "overwrites"
            warnings.simplefilter("ignore", RuntimeWarning)
            path = os.fsencode(self.paths.host(mount))
            wd = reader.add_callback(path, WATCH_MASK, self, CALLBACK_ID)
        if wd < 0:  # InotifyFD does not raise EACCES
            reader.remove_callbacks([(wd, CALLBACK_ID)])
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return wd, dev

    def _unwatch(self, mount: str) -> None:
        with self._lock:
            watch = self.watches.pop(mount, None)
            if watch is None:
                return
            others = tuple(m for m in self._mounts_on.pop(watch.wd, ()) if m != mount)
            if others:
                self._mounts_on[watch.wd] = others  # the watch stays theirs
        if not others and self.inotify is not None:
            with contextlib.suppress(Exception):  # gone with its mount, perhaps
                self.inotify.remove_callbacks([(watch.wd, CALLBACK_ID)])

    def _tell_watching(self) -> None:
        """Told under the lock, as a dropped watch is: the last word said is the watches'
        now (told after the lock, a refresh's True could land after a drop's False)."""
        with self._lock:
            every = self.inotify is not None and bool(self._current)
            every = every and self._current <= self.watches.keys()
            # The run inputs' lock, taken within ours: nothing is taken within it.
            self.outlet.watching(every)

    def stop(self) -> None:
        """For good: discovery, stopped after us, may still publish a mount set."""
        with self._lock:
            self._stopped = True
            reader, self.inotify = self.inotify, None
        close_inotify(reader)

    # --- watchdog's callbacks, on its thread -----------------------------------------------

    def on_event(self, event: InotifyEvent) -> None:
        if not event.name:
            return  # the directory itself (its attributes, unmounted)
        name, mask = os.fsdecode(event.name), event.mask
        kind = "created" if mask & CREATED else "deleted" if mask & DELETED else None
        for mount in self._mounts_on.get(event.wd, ()):
            try:
                self._on_change(mount, None if mask & IN_ISDIR else name, kind)
            except Exception:  # would end the thread that reads every mount's events
                log.exception("mount %s: handling an inotify event failed", mount)

    def _on_change(self, mount: str, name: Optional[str], kind: Optional[str]) -> None:
        """`name` None: a directory changed (what is below it is listed again)."""
        if name is not None and kind is not None:
            self.state.count_event(mount, classify(name), kind)
        with contextlib.suppress(OSError):  # the poll reports the mount's error
            st = os.statvfs(self.paths.host(mount))
            self.state.record_used(mount, (st.f_blocks - st.f_bfree) * st.f_frsize)
        self.outlet.changed(mount, name)

    def on_watch_deleted(self, wd: int) -> None:
        """The kernel dropped a watch (unmounted, directory deleted): polled until a refresh."""
        with self._lock:
            self._settled = None
            for mount in self._mounts_on.pop(wd, ()):
                self.watches.pop(mount, None)
                if self.inotify is not None:  # not stopping
                    self.state.set_inotify(mount, False)
            self.outlet.watching(False)

    def on_queue_overflow(self) -> None:
        """Lost events (one queue serves every mount): counted on each, each re-listed at once."""
        with self._lock:
            watched = list(self.watches)
        for mount in watched:
            self.state.count_overflow(mount)
        log.warning(
            "inotify queue overflowed: events were lost on %d mount(s); running a full inventory",
            len(watched),
        )
        self.outlet.lost(watched)

    def on_events_lost(self) -> None:  # watchdog >= 7.1: after on_queue_overflow
        return None
