"""What one owner scan found. A segment held by nobody is 'orphan' only when every process
that could hold it was read (`Owners.complete`); else 'unverified', and `UnprovenLog` says why.
When the next full scan is (`ScanPace`)."""

import logging
import re
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Collection, Dict, List, Mapping
from typing import Optional, Set, Tuple

from exporter.host.kube import pod_uid_of_mount
from exporter.host.proctable import Process
from exporter.inventory.walk import Key, Listing
from exporter.model.types import MemfdTotals, PackedRow, Row

MAX_UNPROVEN = 20  # reasons kept for the log
Names = Optional[AbstractSet[str]]  # names of a mount's files; None: any
Changes = Dict[str, Names]  # mount -> names changed; None: re-list it all


class UnprovenLog:
    """Logs why unheld segments are 'unverified' when that changes (pids and counts aside),
    and when every process can be read again."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._said: Tuple[str, ...] = ()  # the reasons last logged, numbers left out

    def say(self, owners: "Owners") -> None:
        said = tuple(sorted({re.sub(r"\d+", "#", why) for why in owners.unproven}))
        if said == self._said:
            return
        if said:
            reasons = "; ".join(owners.unproven[:MAX_UNPROVEN])
            self.log.info(
                "segments held by no readable process are 'unverified', not 'orphan': could "
                f"not read {reasons} (--segments.ignore-unreadable excuses root's processes "
                "by name)"
            )
        else:
            self.log.info(
                "every process could be read: segments held by nobody are orphans again"
            )
        self._said = said


@dataclass(frozen=True)
class Sizes:
    """An inode's sizes from a stat (or a mapping's extent for both)."""

    allocated_bytes: int  # st_blocks x 512: what tmpfs charges
    apparent_bytes: int  # st_size
    mtime: float


@dataclass(slots=True)
class Holding:
    """One process's hold on an inode: by a mapping, an open fd, or both (merged)."""

    pid: int
    path: str
    deleted: bool
    extent: int = 0  # bytes the mapping reaches into the file
    map_range: str = ""  # one mapping's "start-end", to stat it through map_files
    sizes: Optional[Sizes] = None  # from fstat of the fd / map_files, when we could


@dataclass
class Owners:
    holdings: Dict[Key, List[Holding]] = field(default_factory=dict)
    comms: Dict[int, str] = field(default_factory=dict)  # comm of each holder
    holders: Dict[int, Process] = field(default_factory=dict)
    # Processes whose stat, maps or fds were denied, or hidden (hidepid). None: uncounted.
    unreadable: Optional[int] = 0
    # Of those, the ones that could hold a segment (not excused by --segments.ignore-unreadable).
    unverifiable: Optional[int] = 0
    unproven: List[str] = field(default_factory=list)  # why unheld is not proven
    scanned: int = 0
    processes: Dict[int, Process] = field(default_factory=dict)  # every one walked
    # pid -> the keys it holds (each once): a scoped scan replaces a pod's holdings by them.
    keys_of: Dict[int, List[Key]] = field(default_factory=dict)
    pod_of: Dict[int, str] = field(default_factory=dict)  # pid -> pod UID, once known
    # pid -> class -> its memfds past its MAX_MEMFDS largest
    memfd_rest: Dict[int, Dict[str, MemfdTotals]] = field(default_factory=dict)
    folded: Set[Key] = field(default_factory=set)  # keys counted so, while a scan runs

    def hold(self, key: Key, new: Holding) -> None:
        for h in self.holdings.setdefault(key, []):
            if h.pid == new.pid:
                h.extent = max(h.extent, new.extent)
                h.deleted |= new.deleted
                h.map_range = h.map_range or new.map_range
                h.sizes = new.sizes or h.sizes
                return
        self.holdings[key].append(new)
        self.keys_of.setdefault(new.pid, []).append(key)

    def unproven_because(self, why: str) -> None:
        # Bounded: thousands of processes are unreadable under hidepid=1.
        if len(self.unproven) < MAX_UNPROVEN:
            self.unproven.append(why)

    @property
    def complete(self) -> bool:  # every process that could hold a segment was read
        return self.unverifiable == 0

    def hold_any(self, devs: Set[int]) -> bool:  # a segment of these devices is held
        return any(dev in devs for dev, _ in self.holdings)


def unlinked_size(hs: List[Holding]) -> Sizes:
    """An unlinked inode's sizes: a stat's, else its furthest mapping's."""
    if sizes := next((h.sizes for h in hs if h.sizes), None):
        return sizes
    extent = max(h.extent for h in hs)
    return Sizes(allocated_bytes=extent, apparent_bytes=extent, mtime=0.0)


def unheld_state(
    name: str,
    row: PackedRow,
    key: Key,
    full_dev: Optional[int],
    doubted: Optional[Collection[str]],
    held_at_full: AbstractSet[Key],
    complete: bool,
    quick: bool,
    settled: bool,
) -> str:
    """A listed file nobody we could inspect holds: an orphan only when we inspected everybody
    who could hold it (`complete`), else unverified. One not known (listed before the last full
    scan read /proc, on the device the mount had then) is taken as held by its creator after a
    quick run, unverified after a refresh. `settled`: a full scan this run, which alone may call
    leaked one held at the last (`held_at_full`) or changed since its pod was read (`doubted`)."""
    if not (settled or full_dev == key[0] and Row.known(row)):
        return "linked" if quick else "unverified"  # `settled` makes every row known
    at_full = doubted is None or name in doubted or key in held_at_full
    return "orphan" if complete and (settled or not at_full) else "unverified"


def joined(a: Names, b: Names) -> Names:
    """Two sets of names, where None is any name."""
    return None if a is None or b is None else a | b


def add_names(book: Changes, mount: str, names: Names) -> None:
    book[mount] = joined(book.get(mount, set()), names)


def orphan_bytes(
    rows: Mapping[str, PackedRow], names: Collection[str]
) -> Dict[str, Optional[int]]:
    """Each of `names`' allocated bytes in `rows` (None: not listed)."""
    return {n: Row.allocated_bytes(rows[n]) if n in rows else None for n in names}


def mounts_to_reread(
    devs: Dict[str, int],
    listings: Mapping[str, Listing],
    orphans: Mapping[str, Collection[str]],
    doubted: Changes,
    read_as: Mapping[str, Mapping[str, Optional[int]]],
) -> Optional[Dict[str, Set[str]]]:
    """The mounts whose pods a refresh reads again, each with its files called leaked (`orphans`)
    whose pages were written since its pod was read (`read_as`: orphan_bytes then; through a
    mapping: no event, but they allocate), or with nothing when only an event named one
    (`doubted`). None: one in no pod's mount, where only a full scan reads whoever may hold it."""
    moved: Dict[str, Set[str]] = {}
    for m in devs:
        was = read_as.get(m, {})
        now = orphan_bytes(listings[m].rows, orphans.get(m, ()))
        written = {n for n, a in now.items() if a is not None and a != was.get(n)}
        if written or m in doubted:
            moved[m] = written
    return None if any(not pod_uid_of_mount(m) for m in moved) else moved


@dataclass(frozen=True)
class _FullScan:
    """What a full scan saw that a later one compares with."""

    mounts: (
        object  # the mounts' devices and statvfs figures, as the collector gives them
    )
    holders: Dict[int, Process]
    keys: AbstractSet[Key]  # every key held


class ScanPace:
    """Node mode: when every process is read again (the full owner scan, which alone may call
    a segment leaked). As cAdvisor's housekeeping, its interval doubles after a scan that found
    nothing changed (no segment created, deleted or written, no mount come, gone or moved, the
    same holders), up to `cap` times the base, and is back to the base on any change."""

    def __init__(self, base: float, cap: int, monotonic: Callable[[], float]):
        self.base = self.every = base
        self.cap, self.monotonic = cap, monotonic
        self.scanned_at = float("-inf")
        self._quiet = False  # nothing changed since the last scan
        self._seen: Optional[_FullScan] = None  # the last full scan's

    def due(self) -> bool:
        return self.monotonic() - self.scanned_at >= self.every

    def changed(self) -> None:
        self._quiet, self.every = False, self.base

    def _same(self, owners: Owners) -> bool:
        seen = self._seen
        return seen is not None and (seen.holders, seen.keys) == (
            owners.holders,
            owners.holdings.keys(),
        )

    def look(self, mounts: object, owners: Optional[Owners] = None) -> None:
        """A full run's mounts, and a refresh's owners: a change from the last scan's?"""
        seen_mounts = None if self._seen is None else self._seen.mounts
        if seen_mounts != mounts or owners and not self._same(owners):
            self.changed()

    def scanned(
        self, mounts: object, owners: Owners, *, quiet: bool, stretch: bool
    ) -> None:
        """`quiet`: no change while it read /proc; `stretch`: inotify watches every mount
        and none is called leaked (an attach without a write only a full scan sees)."""
        calm = self._quiet and quiet and stretch and self._same(owners)
        self.every = min(self.every * 2, self.base * self.cap) if calm else self.base
        self._seen = _FullScan(
            mounts=mounts,
            holders=dict(owners.holders),
            keys=frozenset(owners.holdings),
        )
        self._quiet, self.scanned_at = quiet, self.monotonic()
