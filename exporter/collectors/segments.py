"""Segment inventory: each shm mount's listing (lstat only) joined by (device, inode) to
every process's maps and fds. A quick run patches the listings inotify named, reusing
the last owners: a new segment is its creator's until a full run reads its holders. In
node mode only a full scan (every --segments.full-scan-interval) calls a segment leaked;
refreshes between read new processes and exited holders' and doubted mounts' pods.

A run goes through named stages over its state, a `SegmentRun`:

1. listing (`_list`): each mount's directory walked (a full run), or patched by the names
   inotify saw change (a quick run). On the source's thread.
2. owner scan (`_scan_owners`), full runs only: every process's /proc (a full scan), or
   the pods whose mounts moved (a refresh). On a thread of its own beside quick runs in node
   mode (the scheduler runs `FullRun.scan` there), on the source's thread in a sidecar.
3. assembly (`_assemble`): the listings joined with the owners into the Inventory, after a
   full run's `_settle` took what the scan found. On the source's thread, which publishes.

The directory is listed before /proc is read: a segment unlinked in between is still listed
(not hidden), and one created in between is held but not '(deleted)' (linked).
"""

import logging
import os
import re
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import AbstractSet, Callable, Dict, Iterable, List, Mapping, Optional
from typing import Pattern, Set, Tuple

from exporter.collectors.source import STRETCH_MAX, Context, NamesChanged, RunInput
from exporter.collectors.source import Source, register
from exporter.host.kube import pod_uid_of_mount
from exporter.host.mountinfo import MountTable
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from exporter.host.said import SaidOnce, SaidRun
from exporter.inventory import holdings
from exporter.inventory.holdings import Changes, Owners, ScanPace, UnprovenLog
from exporter.inventory.holdings import unlinked_size
from exporter.inventory.maps import DELETED
from exporter.inventory.owners import OwnerScan
from exporter.inventory.walk import MAX_ENTRIES, Events, Key, Listing
from exporter.inventory.walk import directories, patch_listing, walk
from exporter.model.classes import classify
from exporter.model.types import STATES, ClassTotals, Inventory, MountInventory
from exporter.model.types import PackedRow, Row, Segment

log = logging.getLogger(__name__)
TRUNCATED = f"over {MAX_ENTRIES} entries: files not reached kept as last seen"
DEGRADED = (
    "more than %d files (--inventory.max-segments): only their counts and bytes by class"
    " are kept, as 'unverified', until there are fewer"
)
LINKED, ORPHAN = STATES.index("linked"), STATES.index("orphan")


@dataclass(frozen=True)
class MountFigures:
    """What moves with any change in a mount (node mode's ScanPace compares them)."""

    device: int
    blocks: int
    blocks_free: int
    files: int
    files_free: int


@dataclass(frozen=True)
class MountsSeen:
    """The mounts a full run listed, as a later full scan compares them."""

    devices: Mapping[str, int]
    figures: Mapping[str, MountFigures]


@dataclass(frozen=True)
class ListedMount:
    """One mount as stage 1 left it (on the source's thread), for stage 3 to join."""

    listing: Listing  # the collector's, updated in place run after run
    events: Events  # created and deleted since the last listing


@dataclass
class SegmentRun:
    """One run's state, from its listing to its assembly: made and read on the source's
    thread; a staged run's scan (stage 2, its own thread in node mode) sets `owners`,
    `moved` and `failed` before the source's thread reads them in stage 3."""

    full: bool
    mounts: Tuple[str, ...]  # to assemble, in order (a full run's: merged when it ends)
    devs: Dict[str, int]  # the mounts listed, and their devices
    errors: Dict[str, str]  # the mounts that could not be listed, and why
    seen: MountsSeen  # node mode's full runs: the mounts' figures; else empty
    listed: Dict[str, ListedMount] = field(default_factory=dict)
    # A refresh: the mounts whose pods it reads again, each with the files called leaked
    # that were written since; None: a full scan reads every process.
    moved: Optional[Dict[str, Set[str]]] = None
    owners: Optional[Owners] = None  # the scan's
    failed: Optional[Exception] = None  # the scan's, raised as the run ends
    # Set as a full run ends (a quick run's stay so):
    settled: bool = False  # the owners come from a full scan of every process, this run
    # A refresh's mounts whose pods it did not read (assembled as a quick run's are).
    unread: Set[str] = field(default_factory=set)
    # Names changed while the scan read /proc (None: any): it may have read their takers
    # before, so nothing it found settles them.
    during: Changes = field(default_factory=dict)


class FullRun:
    """A full run's stages after its listing (collectors/source.py's StagedRun)."""

    def __init__(self, collector: "SegmentsCollector", run: SegmentRun) -> None:
        """Made on the source's thread once stage 1 (the listing) is done."""
        self.collector, self.run = collector, run

    def scan(self) -> None:
        """Stage 2, the owner scan: on a thread of its own in node mode, beside quick runs
        (it reads /proc and the last scan's owners, which they read but do not change), else
        on the source's thread. What goes wrong is raised by `finish`."""
        try:
            self.collector._scan_owners(self.run)
        except Exception as err:
            self.run.failed = err

    def finish(self, run: RunInput) -> Inventory:
        """Stage 3, on the source's thread: the owners taken, the inventory assembled.
        `run.changes`: names changed and not taken by a quick run yet."""
        self.collector._settle(self.run, run)
        return self.collector._assemble(self.run, run)

    def abandon(self) -> None:
        """Instead of stages 2 and 3, on the source's thread: the scan never ran."""
        self.collector._abandon(self.run)


class SegmentsCollector(Source):
    """The segments source. Its runs, and every stage that writes its fields, run on the
    source's thread (the scheduler's `shmwatch-segments`); a staged full run's scan, on a
    thread of its own in node mode, reads only `_owners` (replaced, never changed, by stage
    3), the process table and `owner_scan`."""

    name = "segments"
    schedule = "inventory"
    event_driven = True

    def __init__(
        self,
        paths: Paths,
        table: Optional[ProcessTable] = None,
        pod_of_pid: bool = False,
        ignore_unreadable: Optional[Pattern[str]] = None,
        full_scan_interval: float = 0.0,
        monotonic: Callable[[], float] = time.monotonic,
        max_segments: int = 150_000,
    ) -> None:
        """On the thread that builds the App (`_make`) or a test's."""
        self.paths = paths
        self.table = table or ProcessTable(paths)
        self.owner_scan = OwnerScan(self.table, ignore_unreadable)
        self.pod_of_pid = pod_of_pid
        # A sidecar's quick run is followed by a full one within a second. Node mode leaves
        # the holders of new segments to its full scans: a pod read per create costs more.
        self.follows_up = not pod_of_pid
        # Node mode's full scan reads every process on the node: seconds, beside quick runs.
        self.scans_beside_quick_runs = pod_of_pid
        # Node mode: how often every process is read (refreshes between); stretched if calm.
        every = full_scan_interval if pod_of_pid else 0.0
        self.pace = ScanPace(every, STRETCH_MAX, monotonic)
        self._listings: Dict[str, Listing] = {}  # each mount's, for quick runs to patch
        # Per mount; past it, counts by class (a walk stops at MAX_ENTRIES anyway).
        self.max_segments = min(max_segments, MAX_ENTRIES)
        self._truncated, self._degraded = SaidOnce(log), SaidOnce(log)
        self._unproven_log = UnprovenLog(log)  # why nothing is called orphan
        self._owners = Owners()  # the last scan's, for quick runs that skip /proc
        self._during: Optional[Changes] = None  # changed while a full run's scan runs
        self._held_on: Dict[int, List[Key]] = {}  # device -> the keys held on it
        # Each mount's device at the last full scan: a key (device, inode) is known only on
        # the same mount and device (device numbers are reused; tmpfs numbers inodes from 1).
        self._full_devs: Dict[str, int] = {}
        self._held_at_full: Set[Key] = set()  # inodes held at the last full scan
        # The last run's, by mount: also what it called leaked (no set of names beside it:
        # a storm's 100,000 would cost a 4 MiB table).
        self._last: Dict[str, MountInventory] = {}
        # The mounts a failed full run listed, as last assembled until they are again: what
        # they called leaked is doubted by a change as ever.
        self._abandoned: Dict[str, MountInventory] = {}
        # Node mode, per mount: the bytes of the files called leaked when its pod was last
        # read (pages written through a mapping raise no event).
        self._pod_read_as: Dict[str, Dict[str, Optional[int]]] = {}
        # Per mount, the names (None: any) not to call leaked before its pod is read again,
        # and (suspect) before a full scan: changed or written through a mapping though its
        # pod was read again (the writer may be outside it).
        self._doubted: Changes = {}
        self._suspect: Changes = {}
        self._table = MountTable(paths)  # which paths are still mount points
        # The holders' pods, their memfd regions and memory cgroups, kept by quick runs
        # (they reuse the owners).
        self._pod_of: Optional[Dict[int, str]] = None
        self._memfd: List[Segment] = []
        self._cgroup_of: Dict[int, str] = {}

    def stretches(self, run: RunInput) -> bool:
        """Whether the full-run interval may double while results stay the same. Asked on
        the source's thread after a full run (by stage 3 and by the scheduler). Node mode
        only, while inotify watches every mount (a polled one changes unseen) and nothing
        is called leaked (a write through a mapping: refreshes see it)."""
        if not (self.pod_of_pid and run.all_watched):
            return False
        last = [*self._last.values(), *self._abandoned.values()]
        return not any(ORPHAN in inv.states for inv in last)

    def _called_leaked(self, mount: str) -> List[str]:
        """The names the mount's last inventory called leaked (source's thread): the last
        run's, or a failed full run's mount's as last assembled (a mount is in one of
        `_last` and `_abandoned` at most). A mount that could not be listed: none."""
        inv = self._last.get(mount)
        if inv is None:
            inv = self._abandoned.get(mount)
        return _names_in_state(inv, ORPHAN) if inv is not None else []

    # --- the runs: on the source's thread ------------------------------------------------

    def collect(self, run: RunInput) -> Inventory:
        """A full run, its three stages one after the other on the calling thread. The
        scheduler does not call it (it calls `begin_full`, then the stages): a test's, or
        any caller wanting one whole full run at once."""
        staged = FullRun(self, self._list(run, full=True, beside=False))
        staged.scan()
        return staged.finish(replace(run, changes={}))  # nothing else is pending

    def collect_quick(self, run: RunInput) -> Inventory:
        """A quick run, on the source's thread (beside a node-mode scan too): the listings
        inotify named patched (stage 1), assembled with the last scan's owners (stage 3)."""
        return self._assemble(self._list(run, full=False, beside=False), run)

    def begin_full(self, run: RunInput) -> FullRun:
        """A full run's first stage (the listing), on the source's thread: the scheduler
        runs the rest (in node mode `run.changes` are left to the quick runs beside the
        scan)."""
        state = self._list(run, full=True, beside=self.scans_beside_quick_runs)
        return FullRun(self, state)

    # --- stage 1: the listing, on the source's thread ------------------------------------

    def _list(self, run: RunInput, full: bool, beside: bool) -> SegmentRun:
        """Stage 1, on the source's thread: each mount to list, listed; what changed noted.
        A quick run's cost follows the change: only the mounts named (or not yet listed, or
        failed last time). `beside`: a full run whose scan runs beside quick runs."""
        kept = {m for m, inv in self._last.items() if not (full or inv.error)}
        todo = [m for m in run.mounts if full or m in run.changes or m not in kept]
        self._table.refresh()
        devs, errors = directories(self.paths.host, self._table, todo)
        state = SegmentRun(
            full=full,
            mounts=run.mounts,
            devs=devs,
            errors=errors,
            # Taken before the listing: a change in between shows next time.
            seen=self._mounts_seen(devs, full),
        )
        for mount, dev in devs.items():
            state.listed[mount] = self._list_mount(mount, dev, full, run.changes)
        self._forget_mounts(set(run.mounts), errors)
        self._note_changes(run.changes, state)
        if full:
            self._plan_scan(run.changes if beside else {}, state)
        return state

    def _mounts_seen(self, devs: Dict[str, int], full: bool) -> MountsSeen:
        """Stage 1 (source's thread): node mode's full runs' statvfs of each mount, what
        moves with any change, for ScanPace; empty otherwise."""
        figures = {}
        for mount, dev in devs.items() if self.pod_of_pid and full else ():
            with suppress(OSError):
                st = os.statvfs(self.paths.host(mount))
                figures[mount] = MountFigures(
                    device=dev,
                    blocks=st.f_blocks,
                    blocks_free=st.f_bfree,
                    files=st.f_files,
                    files_free=st.f_ffree,
                )
        return MountsSeen(devices=dict(devs), figures=figures)

    def _list_mount(
        self, mount: str, dev: int, full: bool, changes: NamesChanged
    ) -> ListedMount:
        """Stage 1 (source's thread): the mount's listing walked whole or patched by the
        names changed, updated in place, and what was created and deleted since (nothing
        said on its first listing, or across the cap)."""
        listing = self._listings.get(mount)
        first = listing is None
        if listing is None:
            listing = self._listings[mount] = Listing()
        names = None if first else changes.get(mount, frozenset())
        if not (full or names is None or names):
            return ListedMount(listing=listing, events=Counter())  # unchanged since
        root = self.paths.host(mount)
        if not full and names is not None and listing.degraded is None:
            events = patch_listing(root, dev, listing, names)
            return ListedMount(listing=listing, events=events)
        whole = not first and listing.degraded is None
        events = walk(root, dev, listing, self.max_segments)
        said = events if whole and listing.degraded is None else Counter()
        return ListedMount(listing=listing, events=said)

    def _forget_mounts(self, current: AbstractSet[str], errors: Dict[str, str]) -> None:
        """Stage 1 (source's thread): a mount gone, or not listable now: its listing and its
        doubts go with it."""
        for gone in [m for m in self._listings if m in errors or m not in current]:
            for book in (
                self._listings,
                self._pod_read_as,
                self._doubted,
                self._suspect,
            ):
                book.pop(gone, None)

    def _note_changes(self, changes: NamesChanged, state: SegmentRun) -> None:
        """Stage 1 (source's thread): a change (a write, an attach's first pages) to a
        segment called leaked: not called leaked again before its pod is read. While a full
        run's scan reads /proc, what changes is noted for it (a quick run beside it takes
        the names)."""
        for mount, names in changes.items():
            self._doubt_leaks_changed(mount, names)
            if self._during is not None:
                holdings.add_names(self._during, mount, names)
        if changes or any(listed.events for listed in state.listed.values()):
            self.pace.changed()  # (inotify missed what a listing found)

    def _doubt_leaks_changed(
        self, mount: str, names: Optional[AbstractSet[str]]
    ) -> None:
        """Stage 1 (source's thread): the files called leaked among `names` (None: any)
        doubted. Also after a failed full run took the mount's last inventory away
        (`_abandoned`): its leaks were called leaked, and are doubted by a change as ever."""
        if names is not None and not names:
            return
        leaked = self._called_leaked(mount)
        changed = None if names is None else {n for n in leaked if n in names}
        if leaked and (changed is None or changed):
            holdings.add_names(self._doubted, mount, changed)

    def _plan_scan(self, pending: NamesChanged, state: SegmentRun) -> None:
        """Stage 1 of a full run (source's thread): plans stage 2, a full scan of every
        process, or (node mode, between full scans) a refresh of the pods whose mounts
        moved. `pending`: names the quick runs beside the scan will take, noted as changed
        during it."""
        self._during = dict(pending)
        self.pace.look(state.seen)
        if self._owners.processes and not self.pace.due():
            state.moved = holdings.mounts_to_reread(
                state.devs,
                {m: listed.listing for m, listed in state.listed.items()},
                {m: self._called_leaked(m) for m in state.devs},
                self._doubted,
                self._pod_read_as,
            )
            # Someone maps a file called leaked: full scans at their base pace again.
            if state.moved is None or any(state.moved.values()):
                self.pace.changed()

    # --- stage 2: the owner scan, on its own thread (node mode) ---------------------------

    def _scan_owners(self, state: SegmentRun) -> None:
        """Stage 2, the owner scan: on its own thread in node mode (beside quick runs), else
        the source's. Reads /proc only (and the collector's last owners, which quick runs
        read too); writes only `state`."""
        on = set(state.devs.values())
        if state.moved is not None:
            also = {pod_uid_of_mount(m) for m in state.moved} - {""}
            state.owners = self.owner_scan.refresh(on, self._owners, also=also)
        if state.owners is None:  # None from a refresh: a full scan after all
            state.moved = None
            state.owners = self.owner_scan.scan(on, pods=self.pod_of_pid)

    # --- stage 3: settling and assembly, on the source's thread ---------------------------

    def _settle(self, state: SegmentRun, run: RunInput) -> None:
        """Stage 3 of a full run, on the source's thread: its owners are the collector's
        now, and a full scan's settle what the last one left in doubt (raises the scan's
        error). `run`: the mounts now, the names still pending."""
        if state.failed is not None or state.owners is None:
            self._abandon(state)
            raise state.failed or RuntimeError("the owner scan did not run")
        state.during, self._during, self._owners = (
            self._during or {},
            None,
            state.owners,
        )
        for mount, names in run.changes.items():  # not taken by quick runs
            holdings.add_names(state.during, mount, names)
        # A quick run meanwhile may have dropped a mount, or added one: as it left them.
        both, now_listed = dict.fromkeys([*state.mounts, *self._last]), set(run.mounts)
        state.mounts = tuple(m for m in both if m in now_listed)
        if state.moved is not None:
            self._settle_refresh(state, state.moved)
        else:
            self._settle_full_scan(state)
        self._held_on = {}
        for key in self._owners.holdings:
            self._held_on.setdefault(key[0], []).append(key)

    def _abandon(self, state: SegmentRun) -> None:
        """A full run whose scan failed or never ran (source's thread): no scan reads /proc
        now, and the mounts it listed are assembled again by the next quick run (their
        listings moved under the last inventories: it must not hand those back)."""
        self._during = None
        for mount in state.devs:
            inv = self._last.pop(mount, None)
            if inv is not None:
                self._abandoned[mount] = inv

    def _settle_refresh(self, state: SegmentRun, moved: Dict[str, Set[str]]) -> None:
        """Stage 3 (source's thread), after a refresh read some pods again: what was written
        there is suspect until a full scan (the writer may be outside the pod)."""
        self.pace.look(state.seen, self._owners)
        state.unread = set(state.devs) - set(moved)
        for mount, written in moved.items():
            names = holdings.joined(self._doubted.pop(mount, set()), written)
            if names is None or names:
                holdings.add_names(self._suspect, mount, names)

    def _settle_full_scan(self, state: SegmentRun) -> None:
        """Stage 3 (source's thread), after a full scan read every process: only rows listed
        before /proc was read may be called leaked, and nothing is in doubt any more."""
        self._unproven_log.say(self._owners)
        self._full_devs = dict(state.devs)
        self._held_at_full = set(self._owners.holdings)
        self._doubted.clear()
        self._suspect.clear()
        state.settled = True

    def _assemble(self, state: SegmentRun, run: RunInput) -> Inventory:
        """Stage 3 (source's thread), of every run: the inventory, each mount listed this
        run joined with the owners, the others as last assembled; a mount cut short or past
        the cap said so (once while it lasts)."""
        mounts = self._mount_inventories(state)
        self._last, self._abandoned = {m.mount: m for m in mounts}, {}
        for mount in self._pods_read(state):
            rows = self._listings[mount].rows if mount in self._listings else {}
            leaked = self._called_leaked(mount)
            self._pod_read_as[mount] = holdings.orphan_bytes(rows, leaked)
        if state.settled:
            quiet, stretch = not state.during, self.stretches(run)
            self.pace.scanned(state.seen, self._owners, quiet=quiet, stretch=stretch)
        if state.full or self._pod_of is None:
            self._pod_of = self._holders_pods(self._owners)
            self._memfd, self._cgroup_of = self.owner_scan.memfd_regions(self._owners)
        return self._inventory(mounts)

    def _mount_inventories(self, state: SegmentRun) -> List[MountInventory]:
        """Stage 3 (source's thread): each mount's inventory, in order; a mount neither
        listed nor failed this run (most of a quick run's) as the last run left it."""
        truncated = self._truncated.run(state.mounts)
        degraded = self._degraded.run(state.mounts)
        mounts = []
        for mount in state.mounts:
            if mount in state.listed or mount in state.errors:
                inv = self._mount_inventory(state, mount, truncated, degraded)
            else:
                inv = self._last.get(mount)
            if inv is not None:
                mounts.append(inv)
        return mounts

    def _mount_inventory(
        self, state: SegmentRun, mount: str, truncated: SaidRun, degraded: SaidRun
    ) -> Optional[MountInventory]:
        """Stage 3 (source's thread), one mount: listed this run: assembled; not listable
        and never listed: its error; else as the last run left it (the same object: the
        model step reuses its summary)."""
        listed = state.listed.get(mount)
        if mount in state.errors and mount not in self._listings:  # or listed since
            return MountInventory(mount=mount, error=state.errors[mount])
        if listed is not None and listed.listing is self._listings.get(mount):
            listing = listed.listing
            truncated.say(mount, TRUNCATED if listing.truncated else None)
            over = None if listing.degraded is None else DEGRADED % self.max_segments
            degraded.say(mount, over, back="back under --inventory.max-segments")
            return self._join(state, mount, listed)
        return self._last.get(mount)

    def _pods_read(self, state: SegmentRun) -> Iterable[str]:
        """Stage 3 (source's thread): the mounts whose pods this run read, what node mode's
        refreshes compare with. None (empty) in a sidecar: its runs read every process, and a
        storm's copy of every leaked file's size would be waste."""
        if not self.pod_of_pid:
            return ()
        return state.devs if state.settled else state.moved or ()

    def _holders_pods(self, owners: Owners) -> Dict[int, str]:
        """Stage 3 of a full run (source's thread): each holder's pod UID (node mode);
        {} in a sidecar."""
        if not self.pod_of_pid:
            return {}
        pods = {}
        for pid, proc in owners.holders.items():
            pod = owners.pod_of.get(pid) or self.table.pod_uid(proc)
            if pod:
                pods[pid] = pod
        return pods

    def _inventory(self, mounts: List[MountInventory]) -> Inventory:
        """Stage 3 (source's thread): the Inventory published, the mounts assembled with
        the owners' process facts (comms, pods, memfd regions, cgroups)."""
        owners = self._owners
        return Inventory(
            mounts=mounts,
            comms=owners.comms,
            proc_unreadable=owners.unreadable,
            processes_scanned=owners.scanned,
            pods=self._pod_of or {},
            owners_complete=owners.complete,
            unproven=list(owners.unproven),
            memfd=self._memfd,
            memfd_rest=owners.memfd_rest,
            cgroup_of=self._cgroup_of,
        )

    # --- one mount's join ------------------------------------------------------------------

    def _join(
        self, state: SegmentRun, mount: str, listed: ListedMount
    ) -> MountInventory:
        """Stage 3 (source's thread): the mount's listing joined with the owners: linked,
        hidden, orphan, unverified. `quick`: nobody was read for this mount's changes (the
        last scan's owners reused)."""
        quick = not state.full or mount in state.unread
        join = _Join(
            collector=self,
            mount=mount,
            dev=state.devs[mount],
            quick=quick,
            settled=state.settled,
            fresh=state.during.get(mount, frozenset()),
            complete=self._owners.complete and not listed.listing.truncated,
        )
        join.rows(listed.listing)
        join.hidden_segments()
        return join.inventory(listed)


@dataclass
class _Join:
    """One mount's join of its rows with the owners, on the source's thread. `settled`: the
    owners come from a full scan this run, which alone may call a segment leaked (not a
    quick run, a pod's rescan, or a refresh). `fresh`: the names (None: any) that changed
    while the scan read /proc, which may have read their takers before. `complete`: every
    process that could hold a file here was read (a walk cut short: not even the files)."""

    collector: SegmentsCollector
    mount: str
    dev: int
    quick: bool
    settled: bool
    fresh: Optional[AbstractSet[str]]
    complete: bool
    # The names (None: any) not to call leaked here (`_doubted` and `_suspect` joined).
    doubted: Optional[AbstractSet[str]] = None
    states: bytearray = field(default_factory=bytearray)
    held: Dict[int, Tuple[int, ...]] = field(default_factory=dict)  # inode -> pids
    process_bytes: Dict[int, int] = field(default_factory=Counter)
    hidden: List[Segment] = field(default_factory=list)
    accounted: int = 0  # bytes every segment found accounts for
    names: Tuple[str, ...] = ()
    packed: Tuple[PackedRow, ...] = ()

    def rows(self, listing: Listing) -> None:
        """Each listed file's state (source's thread). A settled run marks every row listed
        before /proc was read `known`; a row taken after its taker was read, perhaps, is
        doubted."""
        c = self.collector
        owned = c._owners.holdings
        rows = listing.rows
        # Read once, not per row: a storm's listing is 100,000s of rows.
        states = self.states = bytearray(len(rows))
        fresh, settled, dev = self.fresh, self.settled, self.dev
        self.doubted = self._names_in_doubt()
        accounted = sum(t.allocated_bytes for t in (listing.degraded or {}).values())
        for i, (name, row) in enumerate(rows.items()):
            allocated, inode = Row.allocated_bytes(row), Row.inode(row)
            accounted += allocated
            new = fresh is None or name in fresh
            if settled and not new and not Row.known(row):
                rows[name] = Row.marked_known(row)  # listed before /proc was read
            held = owned.get((dev, inode)) if owned else None
            if held:
                self._held(inode, allocated, {h.pid for h in held})
                continue
            states[i] = STATES.index(self._unheld_state(name, row, inode, new))
        self.accounted = accounted
        # The published rows: the listing's as now (its next run changes the dict, not these).
        self.names, self.packed = tuple(rows), tuple(rows.values())

    def _held(self, inode: int, allocated: int, pids: Set[int]) -> None:
        """Stage 3 (source's thread): a file some process holds: linked (its state's index
        is 0), its bytes counted to each holder."""
        held = self.held[inode] = tuple(sorted(pids))
        for pid in held:
            self.process_bytes[pid] += allocated

    def _names_in_doubt(self) -> Optional[AbstractSet[str]]:
        """Stage 3 (source's thread): the names not to call leaked on this mount now (None:
        any): doubted until its pod is read again, suspect until a full scan."""
        c = self.collector
        suspect = c._suspect.get(self.mount, set())
        return holdings.joined(c._doubted.get(self.mount, set()), suspect)

    def _unheld_state(self, name: str, row: PackedRow, inode: int, new: bool) -> str:
        """Stage 3 (source's thread): a file nobody holds: its state (orphan, unverified,
        ...) by holdings.unheld_state. `new`: it changed while the scan read /proc, so it is judged as a quick run would (never called leaked);
        one listed before and changed since is doubted."""
        c = self.collector
        if new and Row.known(row):  # taken after its taker was read, perhaps
            holdings.add_names(c._doubted, self.mount, {name})
            self.doubted = self._names_in_doubt()
        return holdings.unheld_state(
            name=name,
            row=row,
            key=(self.dev, inode),
            full_dev=c._full_devs.get(self.mount),
            doubted=self.doubted,
            held_at_full=c._held_at_full,
            complete=self.complete,
            quick=True if new else self.quick,
            settled=False if new else self.settled,
        )

    def hidden_segments(self) -> None:
        """Stage 3 (source's thread): each file unlinked and still held on this mount's
        device: hidden (not one listed here), its bytes counted to its holders."""
        owned = self.collector._owners.holdings
        for key in self.collector._held_on.get(self.dev, ()):
            hs = owned[key]
            if key[1] in self.held or not any(h.deleted for h in hs):
                continue  # linked, or created after our listing: the next run lists it
            size = unlinked_size(hs)
            name = os.path.basename(hs[0].path.removesuffix(DELETED))
            pids = tuple(sorted({h.pid for h in hs}))
            segment = Segment(
                name=name,
                cls=classify(name),
                state="hidden",
                allocated_bytes=size.allocated_bytes,
                apparent_bytes=size.apparent_bytes,
                mtime=size.mtime,
                holders=pids,
                key=key,
            )
            self.hidden.append(segment)
            for pid in pids:
                self.process_bytes[pid] += size.allocated_bytes
            self.accounted += size.allocated_bytes

    def inventory(self, listed: ListedMount) -> MountInventory:
        """Stage 3 (source's thread): the mount's MountInventory, frozen for publication
        (its rows copied into tuples: later runs change the listing, not it); what its
        statvfs does not account for is unattributed."""
        listing, error, used = listed.listing, None, 0
        try:
            st = os.statvfs(self.collector.paths.host(self.mount))
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
        except OSError as err:
            error = err.strerror or str(err)
        # A walk cut short: nothing verified, the mount degraded.
        cut_short: Optional[Dict[str, ClassTotals]] = {} if listing.truncated else None
        degraded = listing.degraded or cut_short
        return MountInventory(
            mount=self.mount,
            error=error,
            dev=self.dev,
            names=self.names,
            packed=self.packed,
            states=bytes(self.states),
            held=self.held,
            hidden=tuple(self.hidden),
            other_entries=listing.others,
            used_bytes=used,
            unattributed_bytes=max(0, used - self.accounted),
            process_bytes=dict(self.process_bytes),
            events=listed.events,
            degraded=degraded,
        )


def _names_in_state(inv: MountInventory, state: int) -> List[str]:
    """The names of a mount inventory's rows in `state` (an index in STATES), found by
    bytes.find: a storm's 100,000 rows are searched in C."""
    found, at = [], inv.states.find(state)
    while at >= 0:
        found.append(inv.names[at])
        at = inv.states.find(state, at + 1)
    return found


def _make(c: Context) -> SegmentsCollector:
    """The registry's factory, on the thread that builds the App."""
    ignore = c.cfg.ignore_unreadable
    return SegmentsCollector(
        c.paths,
        c.table,
        pod_of_pid=c.node,
        ignore_unreadable=re.compile(ignore) if ignore else None,
        full_scan_interval=c.cfg.full_scan_interval,
        max_segments=c.cfg.max_segments,
    )


register("segments", _make)
