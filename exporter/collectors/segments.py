"""Segment inventory: what is in each shm mount, who holds it, what is hidden or leaked.

Joins two views by (device, inode): the directory, listed with lstat only
(inventory/walk.py), and every process's maps and fds (inventory/owners.py). A full run
does both; an event-driven quick run patches the last listing with the names inotify
reported (inventory/changes.py) and reuses the owners of the last full run, which follows
within a second; in node mode it rescans the owners in the changed mounts' pods instead,
and the full run keeps to the inventory interval. In node mode a full run reads every
process only every --segments.full-scan-interval; in between it refreshes the owners (new
processes, and the pods of holders that exited), and only a full scan calls a segment leaked.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat as stat_mod
import time
from typing import Callable, Dict, List, Optional, Pattern, Sequence, Set, Tuple


from exporter.model.types import Inventory, MountInventory, Segment
from exporter.collectors import BaseSource, Context, register
from exporter.host.mountinfo import live_mounts
from exporter.host.kube import pod_uid_of_mount
from exporter.inventory.changes import ChangeLog
from exporter.inventory.holdings import DELETED, Owners, UnprovenLog
from exporter.inventory.owners import OwnerScan

from exporter.inventory.walk import (
    MAX_ENTRIES,
    Files,
    Key,
    patch_listing,
    walk,
)
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from exporter.model.classes import classify

log = logging.getLogger(__name__)

Listing = Tuple[Files, Dict[str, int], bool]  # files, other entries by type, truncated


class SegmentsCollector(BaseSource):
    name = "segments"
    schedule = "inventory"
    event_driven = True  # re-run early when inotify sees the mount change

    def __init__(
        self,
        paths: Paths,
        mounts: "Sequence[str] | Callable[[], List[str]]",
        table: Optional[ProcessTable] = None,
        statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
        clock: Callable[[], float] = time.time,
        pod_of_pid: bool = False,
        changes: Optional[ChangeLog] = None,
        ignore_unreadable: Optional[Pattern[str]] = None,
        full_scan_interval: float = 0.0,
        monotonic: Callable[[], float] = time.monotonic,
        watch_epoch: Optional[Callable[[str], Optional[int]]] = None,
    ):
        self.paths = paths
        self.mounts = live_mounts(mounts)  # discovery's current mounts
        self.table = table or ProcessTable(paths)
        self.owner_scan = OwnerScan(self.table, ignore_unreadable)
        self.changes = changes or ChangeLog()  # filled by events.MountWatcher
        self.pod_of_pid = pod_of_pid
        self.stretches = pod_of_pid  # node mode: every process, every pod's directory
        self.statvfs = statvfs
        self.clock = clock
        # Node mode: how long the owners of a full scan are refreshed (owner_scan.refresh)
        # before every process is read again, which alone may call a segment leaked.
        self.full_scan_interval = full_scan_interval if pod_of_pid else 0.0
        self.monotonic = monotonic
        # The state store's watch epoch of a mount (None: not watched): a mount watched since
        # it was last walked, with no event and the same statvfs, is not walked by a refresh.
        self.watch_epoch = watch_epoch
        self._walked_as: Dict[str, tuple] = {}  # _signature() when last walked
        self._dir_times: Dict[
            str, Tuple[int, int]
        ] = {}  # the mount directory's mtime and ctime, this run
        self._sig_now: Dict[str, tuple] = {}  # _signature() of this run, where taken
        self._pod_read_as: Dict[
            str, tuple
        ] = {}  # _signature() when the mount's pod was last read
        self._kept_now: Set[str] = set()  # listing kept as quiet by this run
        self._scanned_at = float("-inf")  # when the last full owner scan ran
        # The last listing of each mount, and its name -> inode index, for quick runs to patch.
        self._listings: Dict[str, Listing] = {}
        self._indexes: Dict[str, Dict[str, Key]] = {}
        self._said_truncated: Set[str] = set()
        self._unproven_log = UnprovenLog(
            log
        )  # why nothing is called orphan, when that changes
        self._owners = (
            Owners()
        )  # from the last full run, for quick runs that skip /proc
        self._known_files: Set[Key] = set()  # inodes listed by the last full run
        # Each mount's device at the last full run: a key (device, inode) counts as known only
        # on the same mount and device (a deleted pod's device number is handed out again,
        # and tmpfs numbers its inodes from 1 per instance).
        self._full_devs: Dict[str, int] = {}
        self._held_at_full: Set[Key] = (
            set()
        )  # inodes some process held at the last full run
        self._last: Dict[
            str, MountInventory
        ] = {}  # the last run's inventory of each mount

    def _mount_dev(self, mount: str) -> int:
        st = os.stat(self.paths.host(mount))
        if not stat_mod.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", mount)
        self._dir_times[mount] = (
            st.st_mtime_ns,
            st.st_ctime_ns,
        )  # a create, unlink or rename moves them
        return st.st_dev

    def collect(self) -> Inventory:
        return self._collect(full=True)

    def collect_quick(self) -> Inventory:
        """Patch the listings with what inotify saw change and re-measure, reusing owners
        from the last full run (which follows within a second)."""
        return self._collect(full=False)

    def _list(
        self,
        mount: str,
        dev: int,
        full: bool,
        changes: Dict[str, Optional[Set[str]]],
        quiet_ok: bool = False,
    ) -> Listing:
        previous = self._listings.get(mount)
        index = self._indexes.get(mount)
        if full or mount in changes:
            # Before the listing: a change while it is read shows at the next look.
            self._sig_now[mount] = self._signature(mount, dev)
        if quiet_ok and previous is not None and self._quiet(mount, changes):
            self._kept_now.add(mount)
            return previous
        if (
            full
            or previous is None
            or index is None
            or (mount in changes and changes[mount] is None)
        ):
            self._walked_as[mount] = self._sig_now.get(mount)
            files, others, truncated = walk(self.paths.host(mount), dev)
            self._indexes[mount] = {name: key for key, (name, _) in files.items()}
            if others.get("directory"):
                self._walked_as[mount] = None  # inotify watches the top directory only
        else:
            files, others, truncated = previous
            if changes.get(mount):
                self._walked_as.pop(
                    mount, None
                )  # patched: walked again by the next full run
                patch_listing(self.paths.host(mount), dev, files, index, changes[mount])
        self._listings[mount] = (files, others, truncated)
        return files, others, truncated

    def _quiet(self, mount: str, changes: Dict[str, Optional[Set[str]]]) -> bool:
        """Nothing in the mount changed since it was walked: the same device (not a tmpfs
        mounted over it), inotify watching it all along (the same watch epoch: not restarted,
        no queue overflow) and seeing nothing, the directory's mtime and ctime the same (a
        create, unlink or rename, also one whose event is still on its way), no
        sub-directories (inotify watches the top one only), and the same statvfs (pages
        written or punched through a mapping, which inotify never sees, move the free
        blocks). 200 quiet pods' directories are walked by full scans, not by every refresh."""
        if self.watch_epoch is None or mount in changes:
            return False
        walked_as = self._walked_as.get(mount)
        if (
            walked_as is None
            or walked_as[1] is None
            or not walked_as[3]
            or not walked_as[5]
        ):
            return False  # not watched then (a change may have gone unseen), or size=0 / nr_inodes=0
        return walked_as == self._sig_now.get(mount)

    def _signature(self, mount: str, dev: int) -> Optional[tuple]:
        """(device, watch epoch or None when not watched, directory times, statvfs blocks,
        free blocks, files, free inodes); None when statvfs fails."""
        epoch = self.watch_epoch(mount) if self.watch_epoch is not None else None
        try:
            st = self.statvfs(self.paths.host(mount))
        except OSError:
            return None
        return (
            dev,
            epoch,
            self._dir_times.get(mount),
            st.f_blocks,
            st.f_bfree,
            st.f_files,
            st.f_ffree,
        )

    @staticmethod
    def _moved(before: Optional[tuple], now: Optional[tuple]) -> bool:
        """Device or statvfs moved (not the watch or the directory: those have events)."""
        return (
            before is not None
            and now is not None
            and (before[0] != now[0] or before[3:] != now[3:])
        )

    def _collect(self, full: bool) -> Inventory:
        devs: Dict[str, int] = {}
        errors: Dict[str, str] = {}
        mount_list = self.mounts()
        for mount in mount_list:
            try:
                devs[mount] = self._mount_dev(mount)
            except OSError as err:
                errors[mount] = err.strerror or str(err)
        # The directory first, then /proc: a segment unlinked in between is still
        # listed (so not called hidden), and one created in between is found held
        # but not '(deleted)', so it is linked, not hidden.
        changes = self.changes.drain()
        refresh = (
            full
            and bool(self._owners.processes)
            and self.monotonic() - self._scanned_at < self.full_scan_interval
        )
        # A full scan walks every directory; a refresh only those that changed.
        self._kept_now, self._sig_now = set(), {}
        listings = {
            mount: self._list(mount, dev, full, changes, quiet_ok=refresh)
            for mount, dev in devs.items()
        }
        for gone in [m for m in self._listings if m not in devs]:
            del self._listings[
                gone
            ]  # a mount that went away (node mode: a deleted pod)
            self._indexes.pop(gone, None)
            self._walked_as.pop(gone, None)
            self._dir_times.pop(gone, None)
            self._pod_read_as.pop(gone, None)
        settled = False  # owners from a full scan of every process, this run
        if full:
            refreshed = None
            if refresh:
                # A mount that moved since its pod was last read (pages written through a
                # mapping: no event) has its pod's processes read again: what they hold, and
                # how big, moved with it. So has one whose events no quick run handled.
                moved = [
                    m
                    for m in devs
                    if m in changes
                    or self._moved(self._pod_read_as.get(m), self._sig_now.get(m))
                ]
                also = {pod_uid_of_mount(m) for m in moved} - {""}
                refreshed = self.owner_scan.refresh(
                    set(devs.values()),
                    self._owners,
                    also=also,
                )
                if refreshed is not None:
                    self._pod_read_as.update(
                        {m: self._sig_now[m] for m in moved if self._sig_now.get(m)}
                    )
            if refreshed is not None:
                self._owners = refreshed
            else:
                # Only a scan after a walk of every directory may call a segment leaked.
                for mount in self._kept_now:
                    listings[mount] = self._list(mount, devs[mount], True, changes)
                # Only what was listed before /proc was read may be called leaked.
                walked = {key for files, _, _ in listings.values() for key in files}
                self._owners = self.owner_scan.scan(
                    set(devs.values()), pods=self.pod_of_pid
                )
                self._scanned_at = self.monotonic()
                self._unproven_log.say(self._owners)
                self._known_files = walked
                self._full_devs = dict(devs)
                self._pod_read_as = {
                    m: sig for m in devs if (sig := self._sig_now.get(m)) is not None
                }
                self._held_at_full = set(self._owners.holdings)
                settled = True
        pods_read = False  # a quick run read the changed mounts' pods (node mode)
        if not full:
            pods_read = self._scoped_owners(changes, set(devs.values()))
            if pods_read:
                # Those mounts' pods were read just now: "moved" counts from here.
                self._pod_read_as.update(
                    {
                        m: sig
                        for m in changes
                        if (sig := self._sig_now.get(m)) is not None
                    }
                )
        touched_pods = (
            {pod_uid_of_mount(m) for m in changes} - {""} if self.pod_of_pid else set()
        )
        mounts = []
        held_on = self._held_on()
        for mount in mount_list:
            if mount in errors:
                mounts.append(MountInventory(mount, error=errors[mount]))
                continue
            last = self._last.get(mount)
            if (
                not full
                and mount not in changes
                and last is not None
                and not last.error
                and (not touched_pods or pod_uid_of_mount(mount) not in touched_pods)
            ):
                # Nothing changed in it, and no owner of it was rescanned (another volume of a
                # rescanned pod is assembled again): the same inventory object, which the model
                # step recognises and does not summarise again.
                mounts.append(last)
                continue
            files, others, truncated = listings[mount]
            if truncated and mount not in self._said_truncated:
                self._said_truncated.add(mount)
                log.warning(
                    "mount %s: more than %d entries; the inventory counts the first %d",
                    mount,
                    MAX_ENTRIES,
                    MAX_ENTRIES,
                )
            # A quick run that read the mount's pod knows what a refresh would: a new segment
            # none of the pod's processes holds is unverified now, not "its creator's" until
            # the refresh says otherwise (the state, and its series, flipped for every create).
            quick = not full and not (
                pods_read and pod_uid_of_mount(mount) in touched_pods
            )
            mounts.append(
                self._assemble(
                    mount,
                    devs[mount],
                    files,
                    others,
                    held_on.get(devs[mount], []),
                    quick=quick,
                    settled=settled,
                )
            )
        self._last = {m.mount: m for m in mounts}
        return self._inventory(mounts)

    def _held_on(self) -> Dict[int, List[Key]]:
        """The held inodes by device: once a run, not once per mount."""
        held_on: Dict[int, List[Key]] = {}
        for key in self._owners.holdings:
            held_on.setdefault(key[0], []).append(key)
        return held_on

    def _inventory(self, mounts: List[MountInventory]) -> Inventory:
        owners = self._owners
        pods = {}
        if self.pod_of_pid:
            pod_of = owners.pod_of
            pods = {
                pid: pod
                for pid, proc in owners.holders.items()
                if (pod := pod_of.get(pid) or self.table.pod_uid(proc))
            }
        return Inventory(
            mounts,
            dict(owners.comms),
            owners.unreadable,
            owners.scanned,
            self.clock(),
            pods,
            owners_complete=owners.complete,
            unproven=list(owners.unproven),
        )

    def _scoped_owners(
        self, changes: Dict[str, Optional[Set[str]]], devs: Set[int]
    ) -> bool:
        """Node mode: rescan the processes of the pods whose mounts changed, not the node's
        (0.2 ms a process: 2,000 processes cost 450 ms per event). A change in a mount with
        no pod (the host's /dev/shm, a runtime's sandbox shm) asks for the full follow-up run
        instead, as in sidecar mode, where the quick run reuses the last full run's owners.
        -> whether the changed mounts' pods were read."""
        pods = {pod_uid_of_mount(mount) for mount in changes}
        if not self.pod_of_pid or not self._owners.processes or "" in pods:
            return False
        if pods:
            self._owners = self.owner_scan.scan_pods(devs, pods, self._owners)
        return bool(pods)

    def _assemble(
        self,
        mount: str,
        dev: int,
        files: Files,
        others: Dict[str, int],
        held_keys: List[Key],
        quick: bool,
        settled: bool,
    ) -> MountInventory:
        """`quick`: nobody was read for this mount's changes (the last scan's owners reused).
        `settled`: the owners come from a full scan this run; otherwise from a quick run
        (the last scan's owners, or a pod's rescan) or a refresh, and only a full scan, with
        every process read, may call a segment leaked."""
        inv = MountInventory(mount, other_entries=others)
        accounted = 0
        holdings = self._owners.holdings
        # Held by nobody we could inspect: an orphan only when we inspected everybody who
        # could hold it; otherwise unverified (never called leaked, never advised for rm).
        unheld_state = "orphan" if self._owners.complete else "unverified"
        # A file new since the last full scan is taken as held by its creator until the
        # follow-up full run says otherwise: no orphan flapping on every create. A refresh
        # read its new processes, and found nobody holding it: unverified until a full scan.
        unknown_state = "linked" if quick else unheld_state if settled else "unverified"
        known_files = (
            self._known_files if self._full_devs.get(mount) == dev else frozenset()
        )
        append = inv.segments.append
        for key, (name, st) in files.items():
            held = holdings.get(key)
            if held:
                holders = tuple(sorted({h.pid for h in held}))
                state = "linked"
            else:
                holders = ()
                state = unheld_state if key in known_files else unknown_state
                if not settled and state == "orphan" and key in self._held_at_full:
                    # Held at the last full scan, unheld in a pod-scoped scan or a refresh:
                    # only a full scan, with its re-reads of new processes, may call it leaked.
                    state = "unverified"
            allocated = st.st_blocks * 512
            append(
                Segment(
                    name,
                    classify(name),
                    state,
                    allocated,
                    st.st_size,
                    st.st_mtime,
                    holders,
                    key,
                )
            )
            accounted += allocated
        for key in held_keys:
            if key in files:
                continue
            hs = holdings[key]
            if not any(h.deleted for h in hs):
                continue  # created after our listing: the next run lists it
            best = next((h for h in hs if h.allocated is not None), None)
            extent = max(h.extent for h in hs)
            allocated = best.allocated if best else extent
            apparent = best.apparent if best else extent
            name = os.path.basename(
                hs[0].path[: -len(DELETED)]
                if hs[0].path.endswith(DELETED)
                else hs[0].path
            )
            append(
                Segment(
                    name,
                    classify(name),
                    "hidden",
                    allocated,
                    apparent,
                    best.mtime if best else 0.0,
                    tuple(sorted({h.pid for h in hs})),
                    key,
                )
            )
            accounted += allocated
        for seg in inv.segments:
            for pid in seg.holders:
                inv.process_bytes[pid] = (
                    inv.process_bytes.get(pid, 0) + seg.allocated_bytes
                )
        try:
            st = self.statvfs(self.paths.host(mount))
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
        watch_epoch=c.watch_epoch,
    )


register("segments", _make)
