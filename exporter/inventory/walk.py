"""Listing a shm mount by lstat only, and patching a listing by the names that changed. Each
regular file is one packed int under its path below the mount (a name alone collides across
sub-directories): 100,000 leaked files take ~15 MB. Past `cap` files a walk keeps counts and
bytes by class (`Listing.degraded`); past MAX_ENTRIES it stops (`Listing.truncated`)."""

import os
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from stat import S_IFDIR, S_IFIFO, S_IFLNK, S_IFMT, S_IFSOCK, S_ISDIR, S_ISREG
from typing import Dict, Iterable, List, Optional, Tuple

from exporter.model.classes import CLASS_NAMES, classify
from exporter.model.types import INO_MASK, INO_SHIFT, KNOWN, SEEN, pack, unpack

MAX_DEPTH = 8  # tools that make sub-directories in /dev/shm nest one or two levels
MAX_ENTRIES = 250_000  # a bound on one walk, so a hostile mount cannot stall us

Key = Tuple[int, int]  # (st_dev, st_ino)
Rows = Dict[str, int]  # path below the mount -> packed row (model.types.pack)
Events = Counter  # (class, "created" | "deleted") -> count

_KINDS = {S_IFDIR: "directory", S_IFLNK: "symlink", S_IFIFO: "fifo", S_IFSOCK: "socket"}
CLASS_INDEX = {name: i for i, name in enumerate(CLASS_NAMES)}


@dataclass(eq=False, slots=True)
class Listing:
    """One mount's listing, kept and updated in place run after run: a walk marks the rows
    it sees with this walk's parity and drops the others after."""

    rows: Rows = field(default_factory=dict)
    others: Dict[str, int] = field(default_factory=dict)
    truncated: bool = False
    # class -> (count, allocated, apparent), once past the cap (rows then empty)
    degraded: Optional[Dict[str, Tuple[int, int, int]]] = None
    parity: int = 0  # SEEN or 0: the bit the last walk set


def _update(listing: Listing, path: str, st: os.stat_result, events: Events) -> None:
    old = listing.rows.get(path)
    same = old is not None and old >> INO_SHIFT & INO_MASK == st.st_ino
    if same:
        cls, known = old & 31, old & KNOWN
    else:
        cls, known = CLASS_INDEX[classify(os.path.basename(path))], 0
    flags = known | listing.parity
    row = pack(cls, flags, st.st_ino, st.st_mtime, st.st_blocks, st.st_size)
    if row != old:
        listing.rows[path] = row
    if not same:
        if old is not None:
            events[CLASS_NAMES[old & 31], "deleted"] += 1
        events[CLASS_NAMES[row & 31], "created"] += 1


def walk(root: str, dev: int, listing: Listing, cap: int) -> Events:
    """Brings the listing up to date: regular files by path (a hard-linked inode once), other
    entries by type. -> the files created and deleted since (a name on another inode: both)."""
    events: Events = Counter()
    listing.parity ^= SEEN
    listing.others, listing.truncated, listing.degraded = Counter(), False, None
    rows, others = listing.rows, listing.others
    linked: set = set()  # inodes with more than one name, seen
    seen = files = 0  # entries, and regular files, this walk met (not rows gone since)
    stack: List[Tuple[str, ...]] = [()]  # sub-directories, as names below the root
    while stack and not listing.truncated:
        names = stack.pop()
        if (opened := _open_below(root, names, dev)) is None:
            continue
        fd, entries = opened
        prefix = "".join(n + "/" for n in names)
        with entries:
            for entry in entries:
                seen += 1
                if seen > MAX_ENTRIES:
                    listing.truncated = True
                    break
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # deleted between readdir and lstat
                if st.st_dev != dev:
                    continue  # something mounted inside: not this mount's
                if S_ISREG(st.st_mode):
                    if st.st_nlink > 1:
                        if st.st_ino in linked:
                            continue
                        linked.add(st.st_ino)
                    files += 1
                    if listing.degraded is None and files > cap:
                        listing.degraded = _degrade(listing)
                    if listing.degraded is not None:
                        cls = classify(entry.name)
                        _add(listing.degraded, cls, st.st_blocks * 512, st.st_size)
                    else:
                        _update(listing, prefix + entry.name, st, events)
                    continue
                others[_KINDS.get(S_IFMT(st.st_mode), "device")] += 1
                if S_ISDIR(st.st_mode) and len(names) < MAX_DEPTH:
                    stack.append(names + (entry.name,))
        os.close(fd)
    gone = [p for p, row in rows.items() if row & SEEN != listing.parity]
    if listing.truncated:  # not reached is not gone: kept as last seen, within the cap
        rows.update((p, rows[p] ^ SEEN) for p in gone)
        gone = []
        if listing.degraded is None and len(rows) > cap:
            listing.degraded = _degrade(listing)
    for path in gone:
        events[CLASS_NAMES[rows.pop(path) & 31], "deleted"] += 1
    if len(gone) > len(rows):  # a dict keeps its size when emptied: a storm's, for good
        listing.rows = dict(rows)
        rows.clear()  # its table freed now, not when the last inventory sharing it goes
    return events


def _add(totals, cls: str, allocated: int, apparent: int) -> None:
    count, a, b = totals.get(cls, (0, 0, 0))
    totals[cls] = (count + 1, a + allocated, b + apparent)


def _degrade(listing: Listing) -> Dict[str, Tuple[int, int, int]]:
    """This walk's rows so far as counts and bytes by class; every row is dropped."""
    totals: Dict[str, Tuple[int, int, int]] = {}
    for row in listing.rows.values():
        if row & SEEN == listing.parity:
            cls, _, _, allocated, apparent = unpack(row)
            _add(totals, CLASS_NAMES[cls], allocated, apparent)
    listing.rows.clear()
    return totals


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _open_below(root: str, names: Tuple[str, ...], dev: int) -> Optional[tuple]:
    """(fd, scandir) of a directory below the root opened one name at a time, never through a
    symlink (one swapped in since our lstat fails here); None when it cannot be opened."""
    fd = None
    with suppress(OSError):
        for name in (root, *names):
            parent, fd = fd, os.open(name, _DIR_FLAGS, dir_fd=fd)
            if parent is not None:
                os.close(parent)
        if os.fstat(fd).st_dev == dev:  # else something mounted over it since we looked
            return fd, os.scandir(fd)
    if fd is not None:
        os.close(fd)
    return None


def patch_listing(root: str, dev: int, listing: Listing, names: Iterable) -> Events:
    """Brings the listing up to date for the top-level names that changed (inotify watches
    the top directory only; a change below it re-lists). -> created and deleted."""
    events: Events = Counter()
    rows = listing.rows
    inodes: Optional[Dict[int, str]] = None  # made once, when a hard link asks
    for name in names:
        try:
            st = os.lstat(os.path.join(root, name))
        except OSError:
            st = None  # deleted (or renamed away)
        if st is None or not S_ISREG(st.st_mode) or st.st_dev != dev:
            if name in rows:
                events[CLASS_NAMES[rows.pop(name) & 31], "deleted"] += 1
            continue
        if st.st_nlink > 1:  # a hard link to a listed inode counts once
            if inodes is None:
                inodes = {r >> INO_SHIFT & INO_MASK: n for n, r in rows.items()}
            if inodes.get(st.st_ino, name) != name:
                continue
            inodes[st.st_ino] = name
        _update(listing, name, st, events)
    return events


def directories(host, table, mounts) -> Tuple[Dict[str, int], Dict[str, str]]:
    """Each mount's device, or why it is not listed. `host`: a mount's path as we see it;
    `table` (host.mountinfo.MountTable) tells which are still mount points."""
    devs, errors = {}, {}
    for mount in mounts:
        try:
            st = None if table.gone(mount) else os.stat(host(mount))
        except OSError as err:
            errors[mount] = err.strerror or str(err)
            continue
        if st is not None and S_ISDIR(st.st_mode):
            devs[mount] = st.st_dev
        else:  # one gone from the mount table: its directory on the disk beneath is not ours
            errors[mount] = "not a mount point" if st is None else "not a directory"
    return devs, errors
