"""Listing a shm mount with lstat only, and patching a listing with the names that changed.
Only directories are opened, never through a symlink; other entries are only counted."""

from __future__ import annotations

import os
import stat as stat_mod
from typing import Dict, Iterable, List, Optional, Tuple

MAX_DEPTH = 8  # tools that make sub-directories in /dev/shm nest one or two levels
MAX_ENTRIES = 250_000  # a bound on one walk, so a hostile mount cannot stall us

Key = Tuple[int, int]  # (st_dev, st_ino)
Files = Dict[Key, Tuple[str, os.stat_result]]

_KINDS = {
    stat_mod.S_IFDIR: "directory",
    stat_mod.S_IFLNK: "symlink",
    stat_mod.S_IFIFO: "fifo",
    stat_mod.S_IFSOCK: "socket",
}


def walk(root: str, dev: int) -> Tuple[Files, Dict[str, int], bool]:
    """-> (regular files by inode, other entries by type, truncated). A hard-linked inode
    counts once; entries on another device or gone mid-walk are skipped."""
    files: Files = {}
    others: Dict[str, int] = {}
    seen = 0
    stack: List[Tuple[str, ...]] = [()]  # sub-directories, as names below the root
    while stack:
        names = stack.pop()
        fd = _open_below(root, names, dev)
        if fd is None:
            continue
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
                    return files, others, True
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # deleted between readdir and lstat
                if st.st_dev != dev:
                    continue  # something mounted inside: not this mount's
                if stat_mod.S_ISREG(st.st_mode):
                    files.setdefault((dev, st.st_ino), (entry.name, st))
                    continue
                kind = _KINDS.get(stat_mod.S_IFMT(st.st_mode), "device")
                others[kind] = others.get(kind, 0) + 1
                if stat_mod.S_ISDIR(st.st_mode) and len(names) < MAX_DEPTH:
                    stack.append(names + (entry.name,))
        os.close(fd)
    return files, others, False


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


def patch_listing(
    root: str, dev: int, files: Files, index: Dict[str, Key], names: Iterable[str]
) -> None:
    """Bring a listing up to date for the names that changed. All are dropped first, then
    those still there added: a rename must not lose the inode to the old name's removal."""
    names = list(names)
    for name in names:
        old = index.pop(name, None)
        if old is not None:
            files.pop(old, None)
    for name in names:
        try:
            st = os.lstat(os.path.join(root, name))
        except OSError:
            continue  # deleted (or renamed away)
        if stat_mod.S_ISREG(st.st_mode) and st.st_dev == dev:
            key = (dev, st.st_ino)
            if key not in files:  # a hard link to a listed inode counts once
                files[key] = (name, st)
                index[name] = key
