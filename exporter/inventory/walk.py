"""Listing a shm mount with lstat only, and patching a listing with the names that changed.
Only directories are opened, never through a symlink; other entries are only counted.

A listing keeps each regular file as one packed int under its path below the mount (a
name alone collides across sub-directories): a leak storm of 100,000 files costs ~15 MB.
Past `cap` files a walk keeps only counts and bytes by class (`Listing.degraded`)."""

from __future__ import annotations

import os
import stat as stat_mod
from typing import Dict, Iterable, List, Optional, Tuple

from exporter.model.classes import CLASS_NAMES, classify
from exporter.model.types import KNOWN, pack, unpack

MAX_DEPTH = 8  # tools that make sub-directories in /dev/shm nest one or two levels
MAX_ENTRIES = 250_000  # a bound on one walk, so a hostile mount cannot stall us

Key = Tuple[int, int]  # (st_dev, st_ino)
Rows = Dict[str, int]  # path below the mount -> packed row (model.types.pack)
Events = Dict[Tuple[str, str], int]  # (class, "created" | "deleted") -> count

_KINDS = {
    stat_mod.S_IFDIR: "directory",
    stat_mod.S_IFLNK: "symlink",
    stat_mod.S_IFIFO: "fifo",
    stat_mod.S_IFSOCK: "socket",
}
CLASS_INDEX = {name: i for i, name in enumerate(CLASS_NAMES)}
INO_MASK = (1 << 64) - 1


class Listing:
    __slots__ = ("rows", "others", "truncated", "degraded")

    def __init__(self, rows: Rows, others: Dict[str, int], truncated: bool = False):
        self.rows, self.others, self.truncated = rows, others, truncated
        # class -> (count, allocated, apparent), once past the cap (rows then empty)
        self.degraded: Optional[Dict[str, Tuple[int, int, int]]] = None


def _row(name: str, st: os.stat_result, old: Optional[int]) -> int:
    """A file's row; the class and the known flag kept from its old row on the same inode."""
    if old is not None and (old >> 6) & INO_MASK == st.st_ino:
        cls, known = old & 31, bool(old & KNOWN)
    else:
        cls, known = CLASS_INDEX[classify(os.path.basename(name))], False
    return pack(cls, known, st.st_ino, st.st_mtime, st.st_blocks, st.st_size)


def walk(root: str, dev: int, previous: Rows, cap: int) -> Listing:
    """Regular files by path (a hard-linked inode once), other entries by type. Entries on
    another device or gone mid-walk are skipped."""
    listing = Listing({}, {})
    rows, others = listing.rows, listing.others
    linked: set = set()  # inodes with more than one name, seen
    seen = 0
    stack: List[Tuple[str, ...]] = [()]  # sub-directories, as names below the root
    while stack:
        names = stack.pop()
        fd = _open_below(root, names, dev)
        if fd is None:
            continue
        prefix = "".join(n + "/" for n in names)
        try:
            entries = os.scandir(fd)
        except OSError:
            os.close(fd)
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > MAX_ENTRIES:
                    os.close(fd)
                    listing.truncated = True
                    return listing
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # deleted between readdir and lstat
                if st.st_dev != dev:
                    continue  # something mounted inside: not this mount's
                if stat_mod.S_ISREG(st.st_mode):
                    if st.st_nlink > 1:
                        if st.st_ino in linked:
                            continue
                        linked.add(st.st_ino)
                    path = prefix + entry.name
                    if listing.degraded is not None:
                        _count(listing.degraded, classify(entry.name), st)
                    elif len(rows) >= cap:
                        listing.degraded = _degrade(rows)
                        _count(listing.degraded, classify(entry.name), st)
                    else:
                        rows[path] = _row(path, st, previous.get(path))
                    continue
                kind = _KINDS.get(stat_mod.S_IFMT(st.st_mode), "device")
                others[kind] = others.get(kind, 0) + 1
                if stat_mod.S_ISDIR(st.st_mode) and len(names) < MAX_DEPTH:
                    stack.append(names + (entry.name,))
        os.close(fd)
    return listing


def _count(totals: Dict[str, Tuple[int, int, int]], cls: str, st) -> None:
    count, allocated, apparent = totals.get(cls, (0, 0, 0))
    totals[cls] = (count + 1, allocated + st.st_blocks * 512, apparent + st.st_size)


def _degrade(rows: Rows) -> Dict[str, Tuple[int, int, int]]:
    """The rows so far as counts and bytes by class; the rows are dropped."""
    totals: Dict[str, Tuple[int, int, int]] = {}
    for row in rows.values():
        cls, _, _, allocated, apparent = unpack(row)
        count, a, b = totals.get(CLASS_NAMES[cls], (0, 0, 0))
        totals[CLASS_NAMES[cls]] = (count + 1, a + allocated, b + apparent)
    rows.clear()
    return totals


def diff(before: Rows, after: Rows, names: Optional[Iterable[str]] = None) -> Events:
    """Files created and deleted between two listings (a name on another inode is both),
    over `names` when only those changed."""
    events: Events = {}
    for name in before.keys() | after.keys() if names is None else names:
        old, new = before.get(name), after.get(name)
        if old is not None and new is not None and (old ^ new) >> 6 & INO_MASK == 0:
            continue  # the same inode
        for row, event in ((old, "deleted"), (new, "created")):
            if row is not None:
                key = (CLASS_NAMES[row & 31], event)
                events[key] = events.get(key, 0) + 1
    return events


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _open_below(root: str, names: Tuple[str, ...], dev: int) -> Optional[int]:
    """A directory below the root opened one name at a time, never through a symlink (one
    swapped in since our lstat fails here); None when it cannot be opened."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return None
    for name in names:
        try:
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = child
    if os.fstat(fd).st_dev != dev:  # something mounted over it since we looked
        os.close(fd)
        return None
    return fd


def patch_listing(root: str, dev: int, rows: Rows, names: Iterable[str]) -> None:
    """Bring a listing's rows up to date for the top-level names that changed (inotify
    watches the top directory only; a change below it re-lists)."""
    for name in names:
        old = rows.pop(name, None)
        try:
            st = os.lstat(os.path.join(root, name))
        except OSError:
            continue  # deleted (or renamed away)
        if stat_mod.S_ISREG(st.st_mode) and st.st_dev == dev:
            if st.st_nlink > 1 and any(
                unpack(r)[1] == st.st_ino for r in rows.values()
            ):
                continue  # a hard link to a listed inode counts once
            rows[name] = _row(name, st, old)
