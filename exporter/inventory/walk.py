"""Listing a shm mount by lstat only, and patching a listing by the names that changed. Each
regular file is one packed int (model.types.Row) under its path below the mount (a name
alone collides across sub-directories): 100,000 leaked files take ~15 MB. Past `cap` files
a walk keeps counts and bytes by class (`Listing.degraded`); past MAX_ENTRIES it stops
(`Listing.truncated`). A file with several names (hard links) is listed once, under the
smallest of its names: its class, and the advice given on it, do not depend on the order a
directory is read in. A row is replaced only when its file changed: the inventories
published share the others. Runs on the segments source's thread."""

import errno
import os
from collections import Counter
from dataclasses import dataclass, field
from stat import S_IFDIR, S_IFIFO, S_IFLNK, S_IFMT, S_IFSOCK, S_ISDIR, S_ISREG
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from exporter.host.mountinfo import MountTable
from exporter.model.classes import CLASS_NAMES, classify
from exporter.model.types import ClassTally, ClassTotals, PackedRow, Row

MAX_DEPTH = 8  # tools that make sub-directories in /dev/shm nest one or two levels
MAX_ENTRIES = 250_000  # a bound on one walk, so a hostile mount cannot stall us
# Past this many names in the directories a walk read, the rows it did not meet again are
# looked up by name, one at a time: a set of every name present would be a storm's 100,000
# new strings (~12 MiB) beside its rows. Below it (~0.5 MiB) the set is cheaper: one readdir.
PRESENT_NAMES_MAX = 4096

Key = Tuple[int, int]  # (st_dev, st_ino)
Rows = Dict[str, PackedRow]  # path below the mount -> its row
Events = Counter[Tuple[str, str]]  # (class, "created" | "deleted") -> count
Directory = Tuple[str, ...]  # a directory below the root, as names

_KINDS = {S_IFDIR: "directory", S_IFLNK: "symlink", S_IFIFO: "fifo", S_IFSOCK: "socket"}
CLASS_INDEX = {name: i for i, name in enumerate(CLASS_NAMES)}


@dataclass(eq=False, slots=True)
class Listing:
    """One mount's listing, kept and brought up to date run after run."""

    rows: Rows = field(default_factory=dict)
    others: Counter[str] = field(default_factory=Counter)  # kind -> entries not files
    truncated: bool = False
    # class -> the totals of its files, once past the cap (rows then empty)
    degraded: Optional[Dict[str, ClassTotals]] = None


@dataclass(slots=True)
class _File:
    """A file of several names met by a walk: the path below the mount its pass lists it
    under so far, and its lstat (one walk's, on its thread: not frozen)."""

    path: str
    stat: os.stat_result


def _update(listing: Listing, path: str, st: os.stat_result, events: Events) -> bool:
    """The row of the file at `path` (its lstat `st`) made or brought up to date (the same
    path on another inode is another file: both events). -> whether its path was listed."""
    old = listing.rows.get(path)
    same = old is not None and Row.inode(old) == st.st_ino
    if old is not None and same:
        cls, known = Row.class_index(old), Row.known(old)
    else:
        cls, known = CLASS_INDEX[classify(os.path.basename(path))], False
    row = Row.pack(
        class_index=cls,
        inode=st.st_ino,
        mtime=st.st_mtime,
        blocks=st.st_blocks,
        apparent_bytes=st.st_size,
        known=known,
    )
    if row != old:
        listing.rows[path] = row
    if not same:
        if old is not None:
            events[Row.class_name(old), "deleted"] += 1
        events[Row.class_name(row), "created"] += 1
    return old is not None


class _Pass:
    """One pass over a mount's directories: every entry lstat()ed (MAX_ENTRIES at most),
    regular files handed to `_file` (a hard-linked inode once, by its smallest name, after
    the others), other entries counted by kind."""

    def __init__(self, root: str, dev: int, listing: Listing) -> None:
        self.root, self.dev, self.listing = root, dev, listing
        self.entries = 0  # entries met (a bound on the walk)
        self.files = 0  # regular files met, each inode once (the cap's count)
        # An inode of several names -> its smallest met yet (one _File kept per inode,
        # however many names: a name that loses is done with at once).
        self.linked: Dict[int, _File] = {}
        self.visited: List[Directory] = []  # directories read to their end

    def run(self) -> bool:
        """-> False when the pass stopped early (`_file` said so)."""
        self.listing.others, self.listing.truncated = Counter(), False
        stack: List[Directory] = [()]
        while stack and not self.listing.truncated:
            if not self._directory(stack.pop(), stack):
                return False
        for smallest in self.linked.values():
            if not self._file(smallest.path, smallest.stat):
                return False
        return True

    def _file(self, path: str, st: os.stat_result) -> bool:
        """A regular file's path below the mount and its lstat. -> False: stop the pass."""
        raise NotImplementedError

    def _directory(self, names: Directory, stack: List[Directory]) -> bool:
        opened = _open_below(self.root, names, self.dev)
        if opened is None:
            return True
        fd, entries = opened
        prefix = "".join(n + "/" for n in names)
        try:
            with entries:
                for entry in entries:
                    if not self._entry(prefix, entry, names, stack):
                        return self.listing.truncated  # cut short, or stopped
        finally:
            os.close(fd)
        self.visited.append(names)
        return True

    def _entry(
        self,
        prefix: str,
        entry: "os.DirEntry[str]",
        names: Directory,
        stack: List[Directory],
    ) -> bool:
        """-> False: the pass stops (MAX_ENTRIES met, or `_file` said so)."""
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            self.listing.truncated = True
            return False
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            self._not_listed(prefix + entry.name)  # deleted between readdir and lstat
            return True
        if st.st_dev != self.dev:
            self._not_listed(prefix + entry.name)  # something mounted inside
            return True
        if S_ISREG(st.st_mode):
            return self._regular(prefix + entry.name, st)
        self.listing.others[_KINDS.get(S_IFMT(st.st_mode), "device")] += 1
        if S_ISDIR(st.st_mode) and len(names) < MAX_DEPTH:
            stack.append(names + (entry.name,))
        return True

    def _not_listed(self, path: str) -> None:
        """A name readdir gave whose file this pass does not list under it: gone before its
        lstat, another mount's, or another name of a file listed under a smaller one."""

    def _regular(self, path: str, st: os.stat_result) -> bool:
        """A file of several names is counted once and handed over after the walk."""
        if st.st_nlink <= 1:
            self.files += 1
            return self._file(path, st)
        file = _File(path=path, stat=st)
        kept = self.linked.setdefault(st.st_ino, file)
        if kept is file:
            self.files += 1
        elif file.path < kept.path:
            self.linked[file.stat.st_ino] = file
            self._not_listed(kept.path)
        else:
            self._not_listed(file.path)
        return True


class _RowPass(_Pass):
    """A pass that lists each file by its row; it stops past the cap."""

    def __init__(self, root: str, dev: int, listing: Listing, cap: int) -> None:
        super().__init__(root, dev, listing)
        self.cap = cap
        self.events: Events = Counter()
        self.listed_before = len(listing.rows)
        self.met = 0  # rows listed before met again by name

    def _file(self, path: str, st: os.stat_result) -> bool:
        if self.files > self.cap:
            return False
        self.met += _update(self.listing, path, st, self.events)
        return True

    def _not_listed(self, path: str) -> None:
        """Its row goes now, counted as met: `_drop_gone` reads the directory again, and
        may find the name (on another file made since: the row's inode is not its)."""
        row = self.listing.rows.pop(path, None)
        if row is not None:
            self.met += 1
            self.events[Row.class_name(row), "deleted"] += 1

    def finish(self) -> Events:
        """Rows not met again are gone; a walk cut short keeps them as last seen (within the
        cap)."""
        listing = self.listing
        if listing.truncated:
            if len(listing.rows) > self.cap:
                listing.degraded = _totals_of(listing.rows)
                listing.rows = {}
            return self.events
        if self.met < self.listed_before:
            self._drop_gone()
        return self.events

    def _drop_gone(self) -> None:
        """The rows whose files the directories read no longer name: by the names present,
        or past PRESENT_NAMES_MAX of them each row's name looked up."""
        rows = self.listing.rows
        present = _regular_files(self.root, self.dev, self.visited, PRESENT_NAMES_MAX)
        if present is None:
            gone = _gone_by_lookup(self.root, self.dev, rows)
        else:
            gone = [path for path in rows if path not in present]
        for path in gone:
            self.events[Row.class_name(rows.pop(path)), "deleted"] += 1
        if len(gone) > len(
            rows
        ):  # a dict keeps its size when emptied: a storm's, for good
            self.listing.rows = dict(rows)
            rows.clear()  # its table freed now


class _TallyPass(_Pass):
    """A pass past the cap: each file counted by class, no rows."""

    def __init__(self, root: str, dev: int, listing: Listing) -> None:
        super().__init__(root, dev, listing)
        self.tallies: Dict[str, ClassTally] = {}

    def _file(self, path: str, st: os.stat_result) -> bool:
        tally = self.tallies.setdefault(classify(os.path.basename(path)), ClassTally())
        tally.add(st.st_blocks * 512, st.st_size)
        return True

    def totals(self) -> Dict[str, ClassTotals]:
        return {cls: tally.totals() for cls, tally in self.tallies.items()}


def walk(root: str, dev: int, listing: Listing, cap: int) -> Events:
    """Brings the listing up to date: regular files by path (a hard-linked inode once), other
    entries by type. -> the files created and deleted since (a name on another inode: both).
    Past `cap` files only their totals by class are kept, until a walk finds `cap` or fewer
    (its listing then said nothing, as a first one)."""
    if listing.degraded is None:
        rows = _RowPass(root, dev, listing, cap)
        if rows.run():
            return rows.finish()
        listing.rows = {}  # past the cap: the rows go at once
    tallies = _TallyPass(root, dev, listing)
    tallies.run()
    if tallies.files <= cap and not listing.truncated:  # back under it: listed again
        listing.degraded = None
        rows = _RowPass(root, dev, listing, cap)
        if rows.run():
            return rows.finish()
        listing.rows = {}
        tallies = _TallyPass(root, dev, listing)
        tallies.run()
    listing.degraded = tallies.totals()
    return Counter()


def _totals_of(rows: Rows) -> Dict[str, ClassTotals]:
    tallies: Dict[str, ClassTally] = {}
    for row in rows.values():
        tally = tallies.setdefault(Row.class_name(row), ClassTally())
        tally.add(Row.allocated_bytes(row), Row.apparent_bytes(row))
    return {cls: tally.totals() for cls, tally in tallies.items()}


def _regular_files(
    root: str, dev: int, directories: Sequence[Directory], limit: int
) -> Optional[Set[str]]:
    """The paths of the regular files in these directories now (names and types only, as
    readdir gives them: no lstat); None past `limit` of them, or when a directory could not
    be read (out of fds or memory): the caller looks each row's name up instead."""
    present: Set[str] = set()
    for names in directories:
        looked = _look_into(root, names, dev)
        try:
            if looked.fd is None:
                if looked.gone:
                    continue  # gone since, with its files
                return None
            prefix = "".join(n + "/" for n in names)
            if not _add_regular_files(present, looked.fd, prefix, limit):
                return None
        finally:
            looked.close()
    return present


def _add_regular_files(present: Set[str], fd: int, prefix: str, limit: int) -> bool:
    """The regular files of the directory `fd` added to `present`, under `prefix`: False
    past `limit` of them, or when it cannot be read."""
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    present.add(prefix + entry.name)
                    if len(present) > limit:
                        return False
    except OSError:
        return False
    return True


def _gone_by_lookup(root: str, dev: int, rows: Rows) -> List[str]:
    """The paths of the rows whose files are gone: their directory is gone (or is a symlink
    now, or another mount), or their name is no regular file of this mount in it. Each name
    is looked up in its directory, opened as a walk opens it (never through a symlink), one
    directory open at a time (rows mostly come a directory after another). What cannot be
    looked up (out of fds or memory) is kept as listed."""
    gone: List[str] = []
    directory: Optional[Directory] = None
    current = _LookedInto()
    try:
        for path in rows:
            parent, _, name = path.rpartition("/")
            names = tuple(parent.split("/")) if parent else ()
            if names != directory:
                current.close()
                directory, current = names, _look_into(root, names, dev)
            if (
                current.gone
                or current.fd is not None
                and not _present(current.fd, name, dev)
            ):
                gone.append(path)
    finally:
        current.close()
    return gone


# Looking up a name, these say it is not there (ELOOP: a symlink, which is not followed).
_GONE_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


@dataclass
class _LookedInto:
    """A directory `_gone_by_lookup` looks names up in: its fd, or why there is none."""

    fd: Optional[int] = None  # None: not opened
    gone: bool = False  # not there, a symlink now, or another mount

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _look_into(root: str, names: Directory, dev: int) -> _LookedInto:
    """The directory opened; gone when it is not there (or another mount now); neither when
    it could not be opened for another reason (its rows kept)."""
    try:
        fd = _open_fd_or_raise(root, names, dev)
    except OSError as err:
        return _LookedInto(gone=err.errno in _GONE_ERRNOS)
    return _LookedInto(fd=fd)


def _present(fd: int, name: str, dev: int) -> bool:
    """Whether `name` is a regular file of this mount in the directory `fd` (not followed);
    True when that cannot be told (kept as listed)."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError as err:
        return err.errno not in _GONE_ERRNOS
    return S_ISREG(st.st_mode) and st.st_dev == dev


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _open_below(
    root: str, names: Tuple[str, ...], dev: int
) -> Optional[Tuple[int, "os._ScandirIterator[str]"]]:
    """(fd, scandir) of a directory below the root (`_open_fd_below`); None when it cannot be
    opened."""
    fd = _open_fd_below(root, names, dev)
    if fd is None:
        return None
    try:
        return fd, os.scandir(fd)
    except OSError:
        os.close(fd)
        return None


def _open_fd_below(root: str, names: Tuple[str, ...], dev: int) -> Optional[int]:
    """The fd of a directory below the root (`_open_fd_or_raise`), on this mount; None when
    it cannot be opened."""
    try:
        return _open_fd_or_raise(root, names, dev)
    except OSError:
        return None


def _open_fd_or_raise(root: str, names: Tuple[str, ...], dev: int) -> int:
    """The fd of a directory below the root opened one name at a time, never through a
    symlink (one swapped in since our lstat fails here: ELOOP), on this mount (mounted over
    since: ENOENT, its files are not there)."""
    fd: Optional[int] = None
    try:
        for name in (root, *names):
            parent, fd = fd, os.open(name, _DIR_FLAGS, dir_fd=fd)
            if parent is not None:
                os.close(parent)
        assert fd is not None  # (root, *names) is never empty
        if os.fstat(fd).st_dev != dev:
            raise FileNotFoundError(errno.ENOENT, "another mount now", name)
    except OSError:
        if fd is not None:
            os.close(fd)
        raise
    return fd


def patch_listing(
    root: str, dev: int, listing: Listing, names: Iterable[str]
) -> Events:
    """Brings the listing up to date for the top-level names that changed (inotify watches
    the top directory only; a change below it re-lists). -> created and deleted."""
    patch = _Patch(listing)
    for name in names:
        try:
            st: Optional[os.stat_result] = os.lstat(os.path.join(root, name))
        except OSError:
            st = None  # deleted (or renamed away)
        if st is None or not S_ISREG(st.st_mode) or st.st_dev != dev:
            patch.gone(name)
        else:
            patch.regular(name, st)
    return patch.events


class _Patch:
    """One patch of a listing (`patch_listing`)."""

    def __init__(self, listing: Listing) -> None:
        self.listing = listing
        self.events: Events = Counter()
        self._inodes: Optional[Dict[int, str]] = (
            None  # made once, when a hard link asks
        )

    def gone(self, name: str) -> None:
        if name in self.listing.rows:
            self.events[Row.class_name(self.listing.rows.pop(name)), "deleted"] += 1

    def regular(self, name: str, st: os.stat_result) -> None:
        """A hard link to a listed inode is listed under the smaller of the two names."""
        if st.st_nlink > 1:
            if self._inodes is None:
                self._inodes = _inodes(self.listing.rows)
            if not _takes_the_name(
                self.listing, self._inodes, name, st.st_ino, self.events
            ):
                return
        _update(self.listing, name, st, self.events)


def _inodes(rows: Rows) -> Dict[int, str]:
    return {Row.inode(row): path for path, row in rows.items()}


def _takes_the_name(
    listing: Listing, inodes: Dict[int, str], name: str, inode: int, events: Events
) -> bool:
    """Whether `name` lists its inode: it is listed under no other name, or a greater one
    (whose row goes)."""
    listed = inodes.get(inode, name)
    if listed != name and listed < name:
        return False
    if listed != name and listed in listing.rows:
        events[Row.class_name(listing.rows.pop(listed)), "deleted"] += 1
    inodes[inode] = name
    return True


def directories(
    host: Callable[[str], str], table: MountTable, mounts: Sequence[str]
) -> Tuple[Dict[str, int], Dict[str, str]]:
    """Each mount's device, or why it is not listed. `host`: a mount's path as we see it;
    `table` tells which are still mount points."""
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
