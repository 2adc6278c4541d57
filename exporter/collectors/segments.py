"""Segment inventory: what is in each shm mount, who holds it, what is hidden or leaked.

Two views are joined by (device, inode), never by path text (the same tmpfs is
/dev/shm in the workload and /host/var/lib/kubelet/... here):
- the directory, walked with lstat only: linked and orphan segments;
- every process's /proc/<pid>/maps and /proc/<pid>/fd: who holds what, and what is
  held but unlinked ('... (deleted)'): hidden segments, which `df` counts and `ls`
  does not (NCCL >= 2.19 unlinks after attach, UCX with UCX_POSIX_USE_PROC_LINK=y,
  torch's file_descriptor strategy, Ray plasma).

Safety: nothing under a mount is opened except directories (for listing); symlinks
are never followed, FIFOs, sockets and devices are only counted.
"""
from __future__ import annotations

import errno
import logging
import heapq
import os
import re
import threading
import stat as stat_mod
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from ..paths import Paths
from ..segment_classes import _CACHE as CLASS_CACHE, classify

log = logging.getLogger(__name__)

DELETED = " (deleted)"
MAX_DEPTH = 8  # tools that make sub-directories in /dev/shm nest one or two levels
MAX_ENTRIES = 250_000  # a bound on one walk, so a hostile mount cannot stall us
PF_KTHREAD = 0x00200000  # include/linux/sched.h: kernel threads map no files
# A pod's UID in a cgroup path: cgroupfs ".../pod<uid>/...", systemd "...-pod<uid_with_underscores>.slice".
POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")

Key = Tuple[int, int]  # (st_dev, st_ino)


@dataclass(slots=True)
class Segment:
    name: str  # basename as found (may hold any bytes, as surrogates)
    cls: str
    state: str  # linked | hidden | orphan
    allocated_bytes: int
    apparent_bytes: int
    mtime: float = 0.0
    holders: Tuple[int, ...] = ()
    key: Key = (0, 0)


@dataclass
class MountInventory:
    mount: str
    error: Optional[str] = None
    segments: List[Segment] = field(default_factory=list)
    other_entries: Dict[str, int] = field(default_factory=dict)
    used_bytes: int = 0
    unattributed_bytes: int = 0
    process_bytes: Dict[int, int] = field(default_factory=dict)
    # Computed once per inventory (in the collector's thread), so a scrape renders a
    # handful of numbers instead of walking 10,000 segments.
    totals: Dict[Tuple[str, str], Tuple[int, int, int]] = field(default_factory=dict)  # count, alloc, apparent
    top: List[Segment] = field(default_factory=list)
    top_processes: List[Tuple[int, int]] = field(default_factory=list)
    oldest_orphan_mtime: Optional[float] = None


def summarise(inv: MountInventory, top_k: int) -> None:
    totals: Dict[Tuple[str, str], List[int]] = {}
    oldest: Optional[float] = None
    for seg in inv.segments:
        acc = totals.get((seg.cls, seg.state))
        if acc is None:
            acc = totals[(seg.cls, seg.state)] = [0, 0, 0]
        acc[0] += 1
        acc[1] += seg.allocated_bytes
        acc[2] += seg.apparent_bytes
        if seg.state == "orphan" and (oldest is None or seg.mtime < oldest):
            oldest = seg.mtime
    inv.totals = {key: (c, a, p) for key, (c, a, p) in totals.items()}
    inv.oldest_orphan_mtime = oldest
    inv.top = heapq.nsmallest(top_k, inv.segments, key=lambda s: (-s.allocated_bytes, s.name))
    inv.top_processes = heapq.nsmallest(top_k, inv.process_bytes.items(), key=lambda kv: (-kv[1], kv[0]))


@dataclass
class Inventory:
    mounts: List[MountInventory]
    comms: Dict[int, str]
    proc_unreadable: int
    processes_scanned: int
    wall_time: float = field(default_factory=time.time)
    pods: Dict[int, str] = field(default_factory=dict)  # pid -> pod UID, in node mode


@dataclass
class Holding:
    """One process's hold on one inode of a watched mount."""
    pid: int
    path: str
    deleted: bool
    extent: int = 0  # bytes the mapping reaches into the file
    allocated: Optional[int] = None  # from fstat of the fd / map_files, when we could
    apparent: Optional[int] = None
    mtime: float = 0.0
    map_range: str = ""  # one mapping's "start-end", to stat it through /proc/<pid>/map_files


# --- pure parsers ---------------------------------------------------------------------

def parse_stat(text: str) -> Tuple[str, int, int]:
    """/proc/<pid>/stat -> (comm, flags, starttime). comm may hold spaces and ')'."""
    open_paren, close_paren = text.index("("), text.rindex(")")
    comm = text[open_paren + 1:close_paren]
    rest = text[close_paren + 2:].split()
    # rest[0] is field 3 (state); flags is field 9, starttime field 22.
    return comm, int(rest[6]), int(rest[19])


def dev_token(dev: int) -> str:
    """st_dev -> ' 00:1a ' as /proc/<pid>/maps prints it (hex, at least two digits)."""
    return " %02x:%02x " % (os.major(dev), os.minor(dev))


MapsLine = Tuple[int, int, str, int, str]  # dev, inode, path, extent, address range


def parse_maps(text: str, tokens: Dict[str, int]) -> List[MapsLine]:
    """Lines of maps on the watched devices -> [(dev, inode, path, extent, address range)].

    `tokens` maps dev_token(dev) to dev. Most lines are anonymous (device 00:00) or
    libraries on a disk; only lines on a watched device are split. tmpfs devices all
    have major 0, so one pass finds every " 00:" that is not " 00:00 " and checks the
    minor against the watched set, however many mounts are watched (200 pods' emptyDirs
    in node mode): a per-mount substring search would cost a pass per mount.
    """
    found: List[MapsLine] = []
    major0 = {tok: dev for tok, dev in tokens.items() if tok.startswith(" 00:")}
    others = {tok: dev for tok, dev in tokens.items() if not tok.startswith(" 00:")}
    if major0:
        pos = text.find(" 00:")
        while pos != -1:
            end_token = text.find(" ", pos + 4)
            token = text[pos:end_token + 1]
            if token in major0:
                line_start = text.rfind("\n", 0, pos) + 1
                line_end = text.find("\n", pos)
                line = text[line_start:line_end if line_end != -1 else len(text)]
                parsed = _parse_maps_line(line, major0[token], token)
                if parsed:
                    found.append(parsed)
                pos = text.find(" 00:", line_end) if line_end != -1 else -1
            else:
                pos = text.find(" 00:", pos + 4)
    for token, dev in others.items():  # a watched directory on a real disk: rare
        if token in text:
            for line in text.split("\n"):  # not splitlines(): "\x1e" or "\x85" may be in a path
                if token in line:
                    parsed = _parse_maps_line(line, dev, token)
                    if parsed:
                        found.append(parsed)
    return found


def _parse_maps_line(line: str, dev: int, token: str) -> Optional[MapsLine]:
    parts = line.split(None, 5)
    # The token must be the device field, not text in a path on another device
    # ("/tmp/x 00:1a y (deleted)" would otherwise fake a hidden segment on 00:1a).
    if len(parts) < 6 or parts[3] != token.strip():
        return None
    try:
        start, end = (int(x, 16) for x in parts[0].split("-"))
        offset, inode = int(parts[2], 16), int(parts[4])
    except ValueError:
        return None
    # map_files/ names a mapping "%lx-%lx", without the zero padding maps uses.
    return dev, inode, parts[5], offset + end - start, f"{start:x}-{end:x}"


# --- the collector ---------------------------------------------------------------------

class ProcScanner:
    """Walks /proc once per inventory: who maps or holds open which inode of the watched mounts.

    comm is read afresh each time from /proc/<pid>/stat (an exec changes it, the
    start time does not); kernel threads (PF_KTHREAD) are skipped before their maps
    and fds are read.
    """

    def __init__(self, paths: Paths):
        self.paths = paths

    def pids(self) -> List[int]:
        try:
            return [int(e.name) for e in os.scandir(self.paths.procfs) if e.name.isdigit()]
        except OSError:
            return []

    def identity(self, pid: int) -> Optional[Tuple[str, bool]]:
        """(comm, is_kernel_thread), or None when the process is gone."""
        try:
            with open(self.paths.proc(pid, "stat"), "rb") as handle:
                raw = handle.read().decode("utf-8", "surrogateescape")
            comm, flags, _start = parse_stat(raw)
        except (OSError, ValueError, IndexError):
            return None
        return comm, bool(flags & PF_KTHREAD)

    def scan(self, devs: Set[int]) -> Tuple[Dict[Key, List[Holding]], Dict[int, str], int, int]:
        """-> (holdings by inode, comm by pid of holders, unreadable count, processes scanned)."""
        tokens = {dev_token(d): d for d in devs}
        holdings: Dict[Key, List[Holding]] = {}
        comms: Dict[int, str] = {}
        unreadable = scanned = 0
        pids = self.pids()
        for pid in pids:
            ident = self.identity(pid)
            if ident is None or ident[1]:
                continue  # gone, or a kernel thread
            scanned += 1
            denied = False
            held_here = False
            try:
                with open(self.paths.proc(pid, "maps"), "rb") as handle:
                    maps = handle.read().decode("utf-8", "surrogateescape")
                for dev, inode, path, extent, map_range in parse_maps(maps, tokens):
                    held_here = True
                    deleted = path.endswith(DELETED)
                    self._add(holdings, (dev, inode), pid, path, deleted, extent=extent, map_range=map_range)
            except OSError as err:
                denied |= err.errno in (errno.EACCES, errno.EPERM)
            fd_dir = self.paths.proc(pid, "fd")
            try:
                fds = os.listdir(fd_dir)
            except OSError as err:
                denied |= err.errno in (errno.EACCES, errno.EPERM)
                fds = []
            for fd in fds:
                link = os.path.join(fd_dir, fd)
                try:
                    target = os.readlink(link)
                    if not target.startswith("/"):
                        continue  # socket:[…], pipe:[…], anon_inode:…
                    st = os.stat(link)  # the open file itself; opens nothing
                except OSError:
                    continue
                if st.st_dev in devs and stat_mod.S_ISREG(st.st_mode):
                    held_here = True
                    self._add(holdings, (st.st_dev, st.st_ino), pid, target, target.endswith(DELETED),
                              allocated=st.st_blocks * 512, apparent=st.st_size, mtime=st.st_mtime)
            if denied:
                unreadable += 1
            if held_here:
                comms[pid] = ident[0]
        self._fill_mapping_sizes(holdings)
        return holdings, comms, unreadable, scanned

    @staticmethod
    def _add(holdings: Dict[Key, List[Holding]], key: Key, pid: int, path: str, deleted: bool,
             extent: int = 0, allocated: Optional[int] = None, apparent: Optional[int] = None,
             mtime: float = 0.0, map_range: str = "") -> None:
        for h in holdings.setdefault(key, []):
            if h.pid == pid:
                h.extent = max(h.extent, extent)
                h.deleted |= deleted
                h.map_range = h.map_range or map_range
                if allocated is not None:
                    h.allocated, h.apparent, h.mtime = allocated, apparent, mtime
                return
        holdings[key].append(Holding(pid, path, deleted, extent, allocated, apparent, mtime, map_range))

    def _fill_mapping_sizes(self, holdings: Dict[Key, List[Holding]]) -> None:
        """For deleted inodes held only by a mapping, stat it through map_files.

        /proc/<pid>/map_files/<start>-<end> needs CAP_SYS_ADMIN; without it the mapping's
        extent stands in for the size (an upper bound for a sparse file).
        """
        for key, hs in holdings.items():
            if any(h.allocated is not None for h in hs) or not any(h.deleted for h in hs):
                continue
            for h in hs:
                if not h.map_range:
                    continue
                try:
                    st = os.stat(self.paths.proc(h.pid, "map_files", h.map_range))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) == key:
                    h.allocated, h.apparent, h.mtime = st.st_blocks * 512, st.st_size, st.st_mtime
                    break


_KINDS = {stat_mod.S_IFDIR: "directory", stat_mod.S_IFLNK: "symlink", stat_mod.S_IFIFO: "fifo",
          stat_mod.S_IFSOCK: "socket"}


def walk(root: str, dev: int, limit: int = MAX_ENTRIES
         ) -> Tuple[Dict[Key, Tuple[str, os.stat_result]], Dict[str, int], bool]:
    """List a mount with lstat only -> (regular files by inode, other entries by type, truncated).

    Hard links to one inode count once (the first name seen). Entries on another
    device (something mounted inside) are skipped. Files that vanish mid-walk are skipped.
    """
    files: Dict[Key, Tuple[str, os.stat_result]] = {}
    others: Dict[str, int] = {}
    seen = 0
    stack = [(root, 0)]
    # The loop body runs once per segment (10,000s on a busy node): locals and inline
    # S_IFMT tests instead of attribute lookups and stat.S_IS* calls.
    ifmt, ifreg, ifdir = stat_mod.S_IFMT(0o177777), stat_mod.S_IFREG, stat_mod.S_IFDIR
    setdefault = files.setdefault
    while stack:
        directory, depth = stack.pop()
        try:
            entries = os.scandir(directory)
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > limit:
                    return files, others, True
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # deleted between readdir and lstat
                kind_bits = st.st_mode & ifmt
                if st.st_dev != dev:
                    continue  # something mounted inside: not this mount's
                if kind_bits == ifreg:
                    setdefault((dev, st.st_ino), (entry.name, st))
                    continue
                kind = _KINDS.get(kind_bits, "device")
                others[kind] = others.get(kind, 0) + 1
                if kind_bits == ifdir and depth < MAX_DEPTH:
                    stack.append((entry.path, depth + 1))
    return files, others, False


class SegmentsCollector:
    name = "segments"
    schedule = "inventory"

    def __init__(self, paths: Paths, mounts: "Sequence[str] | Callable[[], List[str]]",
                 statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
                 clock: Callable[[], float] = time.time, pod_of_pid: bool = False, top_k: int = 10):
        self.paths = paths
        self.top_k = top_k
        self.changes = ChangeLog()  # filled by events.MountWatcher
        # The last listing of each mount, and its name -> inode index, for quick runs to patch.
        self._listings: Dict[str, Tuple[Dict[Key, Tuple[str, os.stat_result]], Dict[str, int], bool]] = {}
        self._indexes: Dict[str, Dict[str, Key]] = {}
        self._said_truncated: Set[str] = set()
        # A list, or (node mode) a callable returning the mounts discovered right now.
        self._mounts = mounts if callable(mounts) else (lambda fixed=list(mounts): fixed)
        self.pod_of_pid = pod_of_pid
        self.statvfs = statvfs
        self.clock = clock
        self.procs = ProcScanner(paths)
        # From the last full run, for event-driven quick runs that skip /proc.
        self._holdings: Dict[Key, List[Holding]] = {}
        self._comms: Dict[int, str] = {}
        self._unreadable = 0
        self._scanned = 0
        self._known_files: Set[Key] = set()  # inodes listed by the last full run
        self._pod_cache: Dict[int, str] = {}

    def _mount_dev(self, mount: str) -> int:
        st = os.stat(self.paths.host(mount))
        if not stat_mod.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", mount)
        return st.st_dev

    def collect(self) -> Inventory:
        return self._collect(full=True)

    def collect_quick(self) -> Inventory:
        """Patch the listings with what inotify saw change and re-measure, reusing owners
        from the last full run (which follows within a second)."""
        return self._collect(full=False)

    def _list(self, mount: str, dev: int, full: bool, changes: Dict[str, Optional[Set[str]]]):
        previous = self._listings.get(mount)
        index = self._indexes.get(mount)
        if full or previous is None or index is None or (mount in changes and changes[mount] is None):
            files, others, truncated = walk(self.paths.host(mount), dev)
            self._indexes[mount] = {name: key for key, (name, _) in files.items()}
        else:
            files, others, truncated = previous
            if changes.get(mount):
                patch_listing(self.paths.host(mount), dev, files, index, changes[mount])
        self._listings[mount] = (files, others, truncated)
        return files, others, truncated

    def _collect(self, full: bool) -> Inventory:
        devs: Dict[str, int] = {}
        errors: Dict[str, str] = {}
        mount_list = self._mounts()
        for mount in mount_list:
            try:
                devs[mount] = self._mount_dev(mount)
            except OSError as err:
                errors[mount] = err.strerror or str(err)
        # The directory first, then /proc: a segment unlinked in between is still
        # listed (so not called hidden), and one created in between is found held
        # but not '(deleted)', so it is linked, not hidden.
        changes = self.changes.drain()
        listings = {}
        for mount, dev in devs.items():
            listings[mount] = self._list(mount, dev, full, changes)
        for gone in [m for m in self._listings if m not in devs]:
            del self._listings[gone]  # a mount that went away (node mode: a deleted pod)
            self._indexes.pop(gone, None)
        if full:
            holdings, comms, unreadable, scanned = self.procs.scan(set(devs.values()))
            self._holdings, self._comms, self._unreadable, self._scanned = holdings, comms, unreadable, scanned
            self._known_files = {key for files, _, _ in listings.values() for key in files}
        mounts = []
        for mount in mount_list:
            if mount in errors:
                mounts.append(MountInventory(mount, error=errors[mount]))
                continue
            files, others, truncated = listings[mount]
            if truncated and mount not in self._said_truncated:
                self._said_truncated.add(mount)
                log.warning("mount %s: more than %d entries; the inventory counts the first %d",
                            mount, MAX_ENTRIES, MAX_ENTRIES)
            mounts.append(self._assemble(mount, devs[mount], files, others, provisional=not full))
        pods = self._pods_of(self._comms) if self.pod_of_pid else {}
        return Inventory(mounts, dict(self._comms), self._unreadable, self._scanned, self.clock(), pods)

    def _pods_of(self, pids) -> Dict[int, str]:
        """pid -> pod UID from /proc/<pid>/cgroup (node mode: holders across all host processes)."""
        pods = {}
        for pid in pids:
            if pid in self._pod_cache:  # a process stays in its pod; pids die before reuse
                pods[pid] = self._pod_cache[pid]
                continue
            try:
                with open(self.paths.proc(pid, "cgroup"), "rb") as handle:
                    text = handle.read().decode("utf-8", "replace")
            except OSError:
                continue
            match = POD_UID.search(text)
            pods[pid] = self._pod_cache[pid] = match.group(1).replace("_", "-") if match else ""
        for pid in [p for p in self._pod_cache if p not in pids]:
            del self._pod_cache[pid]  # gone (or no longer holding): a reused pid is read afresh
        return {pid: pod for pid, pod in pods.items() if pod}

    def _assemble(self, mount: str, dev: int, files: Dict[Key, Tuple[str, os.stat_result]],
                  others: Dict[str, int], provisional: bool) -> MountInventory:
        inv = MountInventory(mount, other_entries=others)
        accounted = 0
        holdings = self._holdings
        # A file new since the last full run is taken as held by its creator until the
        # follow-up full run says otherwise: no orphan flapping on every create.
        unknown_state = "linked" if provisional else "orphan"
        known_files = self._known_files
        append = inv.segments.append
        classes = CLASS_CACHE
        for key, (name, st) in files.items():
            held = holdings.get(key)
            if held:
                holders = tuple(sorted({h.pid for h in held}))
                state = "linked"
            else:
                holders = ()
                state = "orphan" if key in known_files else unknown_state
            allocated = st.st_blocks * 512
            append(Segment(name, classes.get(name) or classify(name), state, allocated, st.st_size, st.st_mtime,
                           holders, key))
            accounted += allocated
        for key, hs in self._holdings.items():
            if key[0] != dev or key in files:
                continue
            if not any(h.deleted for h in hs):
                continue  # created after our listing: the next run lists it
            best = next((h for h in hs if h.allocated is not None), None)
            extent = max(h.extent for h in hs)
            allocated = best.allocated if best else extent
            apparent = best.apparent if best else extent
            name = os.path.basename(hs[0].path[: -len(DELETED)] if hs[0].path.endswith(DELETED) else hs[0].path)
            seg = Segment(name, classify(name), "hidden", allocated, apparent, best.mtime if best else 0.0,
                          tuple(sorted({h.pid for h in hs})), key)
            inv.segments.append(seg)
            accounted += allocated
        for seg in inv.segments:
            for pid in seg.holders:
                inv.process_bytes[pid] = inv.process_bytes.get(pid, 0) + seg.allocated_bytes
        try:
            st = self.statvfs(self.paths.host(mount))
            inv.used_bytes = (st.f_blocks - st.f_bfree) * st.f_frsize
        except OSError as err:
            inv.error = err.strerror or str(err)
        inv.unattributed_bytes = max(0, inv.used_bytes - accounted)
        summarise(inv, self.top_k)
        return inv


class ChangeLog:
    """Names inotify saw change, per mount, for the next event-driven (quick) inventory.

    The quick inventory lstat()s only these names and patches the last listing, instead of
    re-listing 10,000 segments for each create. A mount marked unknown (a change below the
    top directory, or too many names) is re-listed whole.
    """

    MAX_NAMES = 5000  # past this, one re-list is cheaper than name-by-name lstat

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: Dict[str, Optional[Set[str]]] = {}

    def add(self, mount: str, name: str) -> None:
        with self._lock:
            names = self._names.setdefault(mount, set())
            if names is not None:
                names.add(name)
                if len(names) > self.MAX_NAMES:
                    self._names[mount] = None

    def unknown(self, mount: str) -> None:
        with self._lock:
            self._names[mount] = None

    def drain(self) -> Dict[str, Optional[Set[str]]]:
        with self._lock:
            drained, self._names = self._names, {}
        return drained


def patch_listing(root: str, dev: int, files: Dict[Key, Tuple[str, os.stat_result]], index: Dict[str, Key],
                  names: Iterable[str]) -> None:
    """Bring a listing up to date for the names that changed: lstat each, add, update or drop it.

    All changed names are dropped first, then the ones still there added: a rename is two
    names for one inode, and must not lose it to the old name's removal.
    """
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


def owner_label(holders: Iterable[int], comms: Dict[int, str]) -> str:
    """'python[1234]', 'python[1234]+3' for four holders, '' for none."""
    holders = list(holders)
    if not holders:
        return ""
    first = holders[0]
    text = f"{comms.get(first, 'unknown')}[{first}]"
    return text + (f"+{len(holders) - 1}" if len(holders) > 1 else "")
