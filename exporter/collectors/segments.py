"""Segment inventory: each shm mount's listing (lstat only) joined by (device, inode) to
every process's maps and fds. A quick run patches the listings inotify named, reusing
the last owners: a new segment is its creator's until a full run reads its holders. In
node mode only a full scan (every --segments.full-scan-interval) calls a segment leaked;
refreshes between read new processes and exited holders' and doubted mounts' pods."""

import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import suppress
from functools import partial
from typing import Callable, Dict, Iterable, List, Optional, Pattern, Sequence
from typing import Set, Tuple

from exporter.collectors.source import STRETCH_MAX, Context, Source, register
from exporter.host.kube import pod_uid_of_mount
from exporter.host.mountinfo import MountTable, live_mounts
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from exporter.host.said import SaidOnce
from exporter.inventory import holdings
from exporter.inventory.changes import ChangeLog
from exporter.inventory.holdings import Owners, ScanPace, UnprovenLog
from exporter.inventory.holdings import unlinked_size
from exporter.inventory.maps import DELETED
from exporter.inventory.owners import OwnerScan
from exporter.inventory.walk import MAX_ENTRIES, Events, Key, Listing
from exporter.inventory.walk import directories, patch_listing, walk
from exporter.model.classes import classify
from exporter.model.types import KNOWN, STATES, Inventory, MountInventory
from exporter.model.types import Segment, unpack

log = logging.getLogger(__name__)
TRUNCATED = f"over {MAX_ENTRIES} entries: files not reached kept as last seen"
DEGRADED = (
    "more than %d files (--inventory.max-segments): only their counts and bytes by class"
    " are kept, as 'unverified', until there are fewer"
)


class SegmentsCollector(Source):
    name = "segments"
    schedule = "inventory"
    event_driven = True

    def __init__(
        self,
        paths: Paths,
        mounts: "Sequence[str] | Callable[[], List[str]]",
        table: Optional[ProcessTable] = None,
        pod_of_pid: bool = False,
        changes: Optional[ChangeLog] = None,
        ignore_unreadable: Optional[Pattern[str]] = None,
        full_scan_interval: float = 0.0,
        monotonic: Callable[[], float] = time.monotonic,
        all_watched: Callable[[], bool] = lambda: False,
        max_segments: int = 150_000,
    ):
        self.paths = paths
        self.mounts = live_mounts(mounts)
        self.table = table or ProcessTable(paths)
        self.owner_scan = OwnerScan(self.table, ignore_unreadable)
        self.changes = changes or ChangeLog()  # filled by the watcher
        self.pod_of_pid = pod_of_pid
        # A sidecar's quick run is followed by a full one within a second. Node mode leaves
        # the holders of new segments to its full scans: a pod read per create costs more.
        self.follows_up = not pod_of_pid
        self.all_watched = all_watched  # inotify watches every mount
        # Node mode: how often every process is read (refreshes between); stretched if calm.
        every = full_scan_interval if pod_of_pid else 0.0
        self.pace = ScanPace(every, STRETCH_MAX, monotonic)
        self._listings: Dict[str, Listing] = {}  # each mount's, for quick runs to patch
        # Per mount; past it, counts by class (a walk stops at MAX_ENTRIES anyway).
        self.max_segments = min(max_segments, MAX_ENTRIES)
        self._truncated, self._degraded = SaidOnce(log), SaidOnce(log)
        self._unproven_log = UnprovenLog(log)  # why nothing is called orphan
        self._owners = Owners()  # the last scan's, for quick runs that skip /proc
        self._during: Optional[holdings.Changes] = None  # changed while a scan runs
        self._held_on: Dict[int, List[Key]] = {}  # device -> the keys held on it
        # Each mount's device at the last full scan: a key (device, inode) is known only on
        # the same mount and device (device numbers are reused; tmpfs numbers inodes from 1).
        self._full_devs: Dict[str, int] = {}
        self._held_at_full: Set[Key] = set()  # inodes held at the last full scan
        self._last: Dict[str, MountInventory] = {}  # the last run's, by mount
        # Node mode, per mount: the names its last run called leaked, and their bytes when
        # its pod was last read (pages written through a mapping raise no event).
        self._orphans: Dict[str, Set[str]] = {}
        self._pod_read_as: Dict[str, Dict[str, Optional[int]]] = {}
        # Per mount, the names (None: any) not to call leaked before its pod is read again,
        # and (suspect) before a full scan: changed or written through a mapping though its
        # pod was read again (the writer may be outside it).
        self._doubted: Dict[str, Optional[Set[str]]] = {}
        self._suspect: Dict[str, Optional[Set[str]]] = {}
        self._table = MountTable(paths)  # which paths are still mount points
        # The holders' pods and memfd regions, kept by quick runs (they reuse the owners).
        self._pod_of: Optional[Dict[int, str]] = None
        self._memfd: Tuple[List[Segment], Dict[int, str]] = ([], {})

    @property
    def stretches(self) -> bool:
        # Only while inotify watches every mount (a polled one changes unseen) and nothing is
        # called leaked (a write through a mapping: refreshes see it).
        return (
            self.pod_of_pid and self.all_watched() and not any(self._orphans.values())
        )

    def collect(self, full: bool = True) -> Inventory:
        *_, inventory = self._steps(full, staged=False)
        return inventory

    def collect_quick(self) -> Inventory:
        return self.collect(full=False)

    def begin_full(self) -> Optional[Callable[[], Callable[[], Inventory]]]:
        if not self.pod_of_pid:
            return None  # node mode only, where reading every process is slow
        steps = self._steps(True, staged=True)
        next(steps)  # the listing

        def scan():  # reads /proc beside quick runs; -> the step that makes the inventory
            next(steps)
            return partial(next, steps)

        return scan

    def _list(
        self, mount: str, dev: int, full: bool, changes: holdings.Changes
    ) -> Tuple[Listing, Events]:
        """The mount's listing, updated in place, and what was created and deleted since
        (nothing said on its first listing, or across the cap)."""
        listing, names = self._listings.get(mount), changes.get(mount, ())
        if listing is None:
            listing = self._listings[mount] = Listing()
            listing.degraded, names = {}, None  # nothing to compare the first with
        if not (full or names is None or names):
            return listing, {}  # unchanged since the last run (degraded or not)
        if not full and names is not None and listing.degraded is None:
            return listing, patch_listing(self.paths.host(mount), dev, listing, names)
        was = listing.degraded is None
        events = walk(self.paths.host(mount), dev, listing, self.max_segments)
        return listing, events if was and listing.degraded is None else {}

    def _steps(self, full: bool, staged: bool) -> Iterator[Optional[Inventory]]:
        """One run, paused after the listing and after the owner scan (a full run's; it reads
        /proc only, so quick runs may go on beside it when `staged`, and take the change log)."""
        mount_list = self.mounts()
        changes = {} if staged else self.changes.drain()
        # A quick run's cost follows the change: only the mounts named (or not yet listed).
        kept = {m for m, inv in self._last.items() if not (full or inv.error)}
        todo = [m for m in mount_list if m in changes or m not in kept]
        self._table.refresh()
        devs, errors = directories(self.paths.host, self._table, todo)
        # The directory first, then /proc: a segment unlinked in between is still listed
        # (not hidden), and one created in between is held but not '(deleted)' (linked).
        # Node mode's full runs: what moves with any change, for ScanPace. Taken before the
        # listing: a change in between shows next time.
        sigs = {}
        for m, dev in devs.items() if self.pod_of_pid and full else ():
            with suppress(OSError):
                st = os.statvfs(self.paths.host(m))
                sigs[m] = dev, st.f_blocks, st.f_bfree, st.f_files, st.f_ffree
        listings = {m: self._list(m, dev, full, changes) for m, dev in devs.items()}
        current = set(mount_list)
        for gone in [m for m in self._listings if m in errors or m not in current]:
            for d in (self._listings, self._pod_read_as, self._doubted, self._suspect):
                d.pop(gone, None)
        # A change (a write, an attach's first pages) to a segment called leaked: not called
        # leaked again before its pod is read. Staged: the names pending, left in the log.
        seen = self.changes.peek() if staged else changes
        for m, names in seen.items():
            orphans = self._orphans.get(m, set()) if m in self._last else set()
            if orphans and (names is None or names & orphans):
                holdings.add_names(self._doubted, m, names and names & orphans)
            if self._during is not None:  # a full run's scan is reading /proc
                holdings.add_names(self._during, m, names)
        if seen or any(events for _, events in listings.values()):  # (inotify missed)
            self.pace.changed()
        moved: Optional[Dict[str, Set[str]]] = None  # a refresh reads their pods again
        if full:
            self._during = {m: names for m, names in seen.items() if staged}
            self.pace.look((devs, sigs))
            if self._owners.processes and not self.pace.due():
                moved = holdings.mounts_to_reread(
                    devs, listings, self._orphans, self._doubted, self._pod_read_as
                )
                # Someone maps a file called leaked: full scans at their base pace again.
                if moved is None or any(moved.values()):
                    self.pace.changed()
        yield None
        owners = None
        if full:
            on = set(devs.values())
            try:
                if moved is not None:
                    also = {pod_uid_of_mount(m) for m in moved} - {""}
                    owners = self.owner_scan.refresh(on, self._owners, also=also)
                if owners is None:  # None from a refresh: a full scan after all
                    moved, owners = None, self.owner_scan.scan(on, pods=self.pod_of_pid)
            except Exception as err:
                yield None  # raised on the source's thread, as the last step
                self._during = None  # no scan reads /proc now
                # Their listings moved under the last inventories (which share their rows):
                # a quick run must assemble them again, not hand the last ones back.
                for mount in devs:
                    self._last.pop(mount, None)
                raise err
        yield None
        settled = False  # owners from a full scan of every process, this run
        unread: Set[str] = set()  # mounts a refresh assembles as a quick run does
        during: holdings.Changes = {}  # changed while the scan read /proc: maybe missed
        if full:
            during, self._during, self._owners = self._during or {}, None, owners
            for m, names in self.changes.peek().items():  # not drained by quick runs
                holdings.add_names(during, m, names)
            # A quick run meanwhile may have dropped a mount, or added one: as it left them.
            now_listed = set(self.mounts())
            both = dict.fromkeys([*mount_list, *self._last])
            mount_list = [m for m in both if m in now_listed]
            if moved is not None:
                self.pace.look((devs, sigs), self._owners)
                unread = set(devs) - set(moved)
                for m, written in moved.items():
                    names = holdings.joined(self._doubted.pop(m, set()), written)
                    if names is None or names:
                        holdings.add_names(self._suspect, m, names)
            else:
                self._unproven_log.say(self._owners)
                # Only rows listed before /proc was read may be called leaked.
                self._full_devs = dict(devs)
                self._held_at_full = set(self._owners.holdings)
                self._doubted.clear()
                self._suspect.clear()
                settled = True
            self._held_on = {}
            for key in self._owners.holdings:
                self._held_on.setdefault(key[0], []).append(key)
        mounts = []
        for mount in mount_list:
            listing, events = listings.get(mount, (None, {}))
            if mount in errors and mount not in self._listings:  # or listed since
                mounts.append(MountInventory(mount, error=errors[mount]))
            elif listing is not None and listing is self._listings.get(mount):
                quick, fresh = not full or mount in unread, during.get(mount, ())
                inv = self._assemble(
                    mount, devs[mount], listing, events, quick, settled, fresh
                )
                mounts.append(inv)
            elif mount in self._last:
                # Unchanged, or changed by a quick run during the scan: as last assembled
                # (the same object: the step reuses its summary).
                mounts.append(self._last[mount])
        self._last = {m.mount: m for m in mounts}
        self._orphans = {m: o for m, o in self._orphans.items() if m in self._last}
        for m in self._pods_read(devs, moved, settled):
            rows = self._listings[m].rows if m in self._listings else {}
            self._pod_read_as[m] = holdings.orphan_bytes(rows, self._orphans.get(m, ()))
        owners = self._owners
        if settled:
            quiet, stretch = not during, self.stretches
            self.pace.scanned((devs, sigs), owners, quiet=quiet, stretch=stretch)
        if full or self._pod_of is None:
            self._pod_of = {
                pid: pod
                for pid, proc in owners.holders.items()
                if self.pod_of_pid
                and (pod := owners.pod_of.get(pid) or self.table.pod_uid(proc))
            }
            self._memfd = self.owner_scan.memfd_regions(owners)
        yield Inventory(
            mounts,
            owners.comms,
            owners.unreadable,
            owners.scanned,
            pods=self._pod_of,
            owners_complete=owners.complete,
            unproven=list(owners.unproven),
            memfd=self._memfd[0],
            memfd_rest=owners.memfd_rest,
            cgroup_of=self._memfd[1],
        )

    def _pods_read(
        self, devs: Dict[str, int], moved: Optional[Dict[str, Set[str]]], settled: bool
    ) -> Iterable[str]:
        """The mounts whose pods this run read: what node mode's refreshes compare with. None
        in a sidecar: its runs read every process, and a storm's copy of every leaked file's
        size would be waste."""
        if not self.pod_of_pid:
            return ()
        return devs if settled else moved or ()

    def _assemble(self, mount, dev, listing, events, quick, settled, fresh=()):
        """`quick`: nobody was read for this mount's changes (the last scan's owners reused).
        `settled`: the owners come from a full scan this run, which alone may call a segment
        leaked (not a quick run, a pod's rescan, or a refresh). `fresh`: the names (None: any)
        that changed while the scan read /proc, which may have read their takers before."""
        if listing.truncated:
            self._truncated.say(mount, TRUNCATED)
        degraded = None if listing.degraded is None else DEGRADED % self.max_segments
        self._degraded.say(mount, degraded, back="back under --inventory.max-segments")
        owned = self._owners.holdings
        complete = self._owners.complete and not listing.truncated  # kept: maybe gone
        full_dev = self._full_devs.get(mount)
        suspect, was_held = self._suspect.get(mount, set()), self._held_at_full
        doubted = holdings.joined(self._doubted.get(mount, set()), suspect)
        rows = listing.rows
        states = bytearray(len(rows))
        held_pids: Dict[int, Tuple[int, ...]] = {}
        inv = MountInventory(mount, dev=dev, other_entries=listing.others)
        bytes_of = inv.process_bytes
        orphans = self._orphans[mount] = set()
        accounted = sum(a for _, a, _ in (listing.degraded or {}).values())
        for i, (name, row) in enumerate(rows.items()):
            _, ino, _, allocated, _ = unpack(row)
            accounted += allocated
            new = fresh is None or name in fresh
            if settled and not new and not row & KNOWN:
                rows[name] = row | KNOWN  # listed before /proc was read, this run
            key = (dev, ino)
            held = owned.get(key) if owned else None
            if held:
                pids = held_pids[ino] = tuple(sorted({h.pid for h in held}))
                for pid in pids:
                    bytes_of[pid] = bytes_of.get(pid, 0) + allocated
                continue  # linked: states[i] is 0
            if new and row & KNOWN:  # taken after its taker was read, perhaps
                holdings.add_names(self._doubted, mount, {name})
                doubted = holdings.joined(self._doubted[mount], suspect)
            how = (True, False) if new else (quick, settled)  # (quick, settled)
            state = holdings.unheld_state(
                name, row, key, full_dev, doubted, was_held, complete, *how
            )
            states[i] = STATES.index(state)
            if state == "orphan":
                orphans.add(name)
        for key in self._held_on.get(dev, ()):
            hs = owned[key]
            if key[1] in held_pids or not any(h.deleted for h in hs):
                continue  # linked, or created after our listing: the next run lists it
            size = unlinked_size(hs)
            name = os.path.basename(hs[0].path.removesuffix(DELETED))
            pids = tuple(sorted({h.pid for h in hs}))
            inv.hidden.append(Segment(name, classify(name), "hidden", *size, pids, key))
            for pid in pids:
                bytes_of[pid] = bytes_of.get(pid, 0) + size[0]
            accounted += size[0]
        inv.listed, inv.states, inv.held = rows, bytes(states), held_pids
        inv.events = events  # a walk cut short: nothing verified, the mount degraded
        inv.degraded = listing.degraded or ({} if listing.truncated else None)
        try:
            st = os.statvfs(self.paths.host(mount))
            inv.used_bytes = (st.f_blocks - st.f_bfree) * st.f_frsize
        except OSError as err:
            inv.error = err.strerror or str(err)
        inv.unattributed_bytes = max(0, inv.used_bytes - accounted)
        return inv


def _make(c: Context) -> SegmentsCollector:
    ignore = c.cfg.ignore_unreadable
    return SegmentsCollector(
        c.paths,
        c.mounts,
        c.table,
        pod_of_pid=c.node,
        changes=c.changes,
        ignore_unreadable=re.compile(ignore) if ignore else None,
        full_scan_interval=c.cfg.full_scan_interval,
        all_watched=c.all_watched,
        max_segments=c.cfg.max_segments,
    )


register("segments", _make)
