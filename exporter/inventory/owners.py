"""Who maps or holds open which inode of the watched mounts: one pass over /proc.

Joined with the directory by (device, inode), never by path text (the same tmpfs is
/dev/shm in the workload and /host/var/lib/kubelet/... here). What is held but unlinked
('... (deleted)') is a hidden segment, which `df` counts and `ls` does not (NCCL >= 2.19
unlinks after attach, UCX with UCX_POSIX_USE_PROC_LINK=y, torch's file_descriptor
strategy, Ray plasma).
"""
from __future__ import annotations

import errno
import os
import stat as stat_mod
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Pattern, Set, Tuple

from ..paths import read_text
from ..proctable import Process, ProcessTable
from .walk import Key

DELETED = " (deleted)"
MAX_UNPROVEN = 20  # reasons kept for the log
MapsLine = Tuple[int, int, str, int, str]  # dev, inode, path, extent, address range


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


@dataclass
class Owners:
    """What one owner scan found."""
    holdings: Dict[Key, List[Holding]] = field(default_factory=dict)
    comms: Dict[int, str] = field(default_factory=dict)  # comm of each holder
    holders: Dict[int, Process] = field(default_factory=dict)
    # Processes we could not inspect: stat, maps or fds denied (another UID without ptrace
    # access, hidepid=1), or not even listed (hidepid=2). None: some exist, uncounted.
    unreadable: Optional[int] = 0
    # Of those, the ones that could hold a segment (not excused by --segments.ignore-unreadable).
    unverifiable: Optional[int] = 0
    # Why 'held by nobody' is not proven, for the log: "process_api (pid 1, uid 0)", ...
    unproven: List[str] = field(default_factory=list)
    scanned: int = 0
    processes: Dict[int, Process] = field(default_factory=dict)  # every process walked (scoped scans)
    pod_of: Dict[int, str] = field(default_factory=dict)  # pid -> pod UID of `processes`, once known

    def unproven_because(self, why: str) -> None:
        if len(self.unproven) < MAX_UNPROVEN:  # thousands of unreadable processes under hidepid=1
            self.unproven.append(why)

    @property
    def complete(self) -> bool:
        """Every process that could hold a segment was inspected: 'held by nobody' is proven."""
        return self.unverifiable == 0


def dev_token(dev: int) -> str:
    """st_dev -> ' 00:1a ' as /proc/<pid>/maps prints it (hex, at least two digits)."""
    return " %02x:%02x " % (os.major(dev), os.minor(dev))


class DeviceTokens(Dict[str, int]):
    """dev_token(dev) -> dev for the watched devices, split once per scan (not once per
    process: 2,000 processes x 200 devices) into tmpfs devices (major 0) and the rest."""

    def __init__(self, tokens: Dict[str, int]):
        super().__init__(tokens)
        self.major0 = {tok: dev for tok, dev in tokens.items() if tok.startswith(" 00:")}
        self.others = {tok: dev for tok, dev in tokens.items() if not tok.startswith(" 00:")}

    @classmethod
    def of(cls, devs: Set[int]) -> "DeviceTokens":
        return cls({dev_token(d): d for d in devs})


def parse_maps(text: str, tokens: Dict[str, int]) -> List[MapsLine]:
    """Lines of maps on the watched devices -> [(dev, inode, path, extent, address range)].

    `tokens` maps dev_token(dev) to dev. Most lines are anonymous (device 00:00) or
    libraries on a disk; only lines on a watched device are split. tmpfs devices all
    have major 0, so one pass finds every " 00:" that is not " 00:00 " and checks the
    minor against the watched set, however many mounts are watched (200 pods' emptyDirs
    in node mode): a per-mount substring search would cost a pass per mount.
    """
    found: List[MapsLine] = []
    split = tokens if isinstance(tokens, DeviceTokens) else DeviceTokens(tokens)
    major0, others = split.major0, split.others
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


def _denied(err: OSError) -> bool:
    return err.errno in (errno.EACCES, errno.EPERM)


class OwnerScan:
    """Reads the maps and fds of the processes the table lists; comm comes from the table
    (read afresh each walk: an exec changes comm, the start time does not)."""

    def __init__(self, table: ProcessTable, ignore_unreadable: Optional[Pattern[str]] = None):
        self.table = table
        self.ignore_unreadable = ignore_unreadable
        # mount namespace -> mount IDs of watched devices in it, and which namespace each
        # process was learnt in (a process whose namespace we cannot name: "pid:<pid>"), so
        # that a namespace's IDs leave with its last process (_forget_mount_ids)
        self._ns_mounts: Dict[str, Optional[Set[int]]] = {}
        self._ns_of: Dict[int, str] = {}
        self._all_mount_ids: Set[int] = set()  # their union (_learn_mount_ids)
        self._learned_devs: Set[int] = set()  # the watched devices they were learnt for
        self._kernel_threads: Set[int] = set()  # pids a scoped scan need not identify again

    # A holder may fork and exit while we read the others: its child, started after /proc was
    # listed, holds the segment. Processes that appeared during a pass are read in another,
    # up to this many; still new ones after that leave the scan unproven.
    MAX_PASSES = 4

    def scan(self, devs: Set[int], pods: bool = False) -> Owners:
        # SysV's walk of the same moment is reused (both run once per scrape); whoever
        # started since is read by the passes below, as after a walk of our own.
        walked = self.table.recent_walk(max_age=1.0)
        # Whoever we could not even identify could hold anything.
        out = Owners(unreadable=walked.unreadable, unverifiable=walked.unreadable)
        if walked.unreadable:
            out.unproven_because(f"{walked.unreadable} process(es) whose stat could not be read")
        if walked.invisible is None or not walked.workload_visible:
            out.unreadable = out.unverifiable = None
            out.unproven_because("hidden processes (hidepid), uncounted" if walked.invisible is None
                                else "the workload's processes: only shmwatch and its parents are visible "
                                "(a PID namespace of its own)")
        elif walked.invisible:
            out.unreadable += walked.invisible
            out.unverifiable += walked.invisible
            out.unproven_because(f"{walked.invisible} process(es) hidden by hidepid")
        out.processes = {p.pid: p for p in walked.processes}
        tokens = DeviceTokens.of(devs)
        self._learn_mount_ids(walked.processes, devs)
        processes = walked.processes
        for _ in range(self.MAX_PASSES):
            for proc in processes:
                self._scan_process(proc, devs, tokens, out)
            processes = self._started_since(set(out.processes))
            if not processes:
                break
            out.processes.update({p.pid: p for p in processes})
        else:
            out.unverifiable = None  # processes kept appearing: some were never read
            out.unproven_because(f"processes kept starting over {self.MAX_PASSES} passes")
        self._fill_mapping_sizes(out.holdings)
        if pods:  # node mode: the holders' pods, for the inventory and for refresh() once they exit
            out.pod_of = {pid: self.table.pod_uid(p) for pid, p in out.holders.items()}
        return out

    def refresh(self, devs: Set[int], previous: Owners) -> Optional[Owners]:
        """Node mode between full scans: read only what may have changed since `previous`.
        A process started since is read; a holder that exited has its pod read again (a
        pod-mate may have attached since, or nobody holds the segment now); everyone else's
        holdings carry over. A process exiting that held nothing changes no holding. None
        when that cannot be scoped (a holder outside any pod exited): scan in full."""
        try:
            alive = set(self.table.pids())
        except OSError:
            return None
        pods = set()
        for pid in previous.holders.keys() - alive:
            pod = previous.pod_of.get(pid)
            if not pod:
                return None
            pods.add(pod)
        return self.scan_pods(devs, pods, previous, new_too=True, alive=alive)

    def scan_pods(self, devs: Set[int], pods: Set[str], previous: Owners, new_too: bool = False,
                  alive: Optional[Set[int]] = None) -> Owners:
        """Rescan only the processes of `pods` (node mode: an event in a pod's mount), and
        with `new_too` every process started since `previous`; every other process's
        holdings carry over from `previous`, so a segment another pod holds never turns
        orphan because it was not looked at. New processes are identified (their pod read
        from their cgroup); processes gone are dropped with their holdings only when in
        scope: the next full scan settles the rest."""
        alive = set(self.table.pids()) if alive is None else alive
        processes = {pid: p for pid, p in previous.processes.items() if pid in alive}
        self._kernel_threads &= alive
        unidentified = 0
        new: List[Process] = []
        for pid in alive - processes.keys() - self._kernel_threads:
            try:
                ident = self.table.identify(pid)
            except (OSError, ValueError, IndexError):
                unidentified += 1  # a new process we cannot read could hold anything
                continue
            if ident is None:
                continue
            if ident[1]:
                self._kernel_threads.add(pid)  # not asked again while it lives
            else:
                processes[pid] = ident[0]
                new.append(ident[0])
        # Each process's pod, looked up once per process (holders' at the full scan, the
        # others' when a pod is first rescanned) and then per new one: 10 events a second
        # on a 2,000-process node asked 6,000 times a run.
        pod_of = {pid: previous.pod_of[pid] for pid in processes if pid in previous.pod_of}
        if pods:
            pod_of.update({pid: self.table.pod_uid(p) for pid, p in processes.items() if pid not in pod_of})
            previous.pod_of.update(pod_of)
        else:
            pod_of.update({p.pid: self.table.pod_uid(p) for p in new})
        scope = [processes[pid] for pid, pod in pod_of.items() if pod in pods]
        if new_too:
            scope += [p for p in new if pod_of.get(p.pid) not in pods]
        fresh = Owners()
        tokens = DeviceTokens.of(devs)
        if devs == self._learned_devs:
            # The others' namespaces are known. An exited process's namespace leaves with
            # the last of its processes: the kernel hands freed namespace inodes and mount
            # IDs out again, and a stale ID could name a FUSE mount whose files must never
            # be stat'ed.
            self._forget_mount_ids(previous.processes.keys() - alive)
            self._learn_mount_ids(new, devs, again=False)
        else:
            self._learn_mount_ids(list(processes.values()), devs)  # a watched mount came or went
        for proc in scope:
            self._scan_process(proc, devs, tokens, fresh)
        self._fill_mapping_sizes(fresh.holdings)
        was_in_scope = {pid for pid, pod in previous.pod_of.items() if pod in pods}
        replaced = was_in_scope | {p.pid for p in scope}
        # A process of the pod we could not read now leaves the proof to the next full scan.
        unverifiable = previous.unverifiable if not (fresh.unverifiable or unidentified) else None
        unreadable = previous.unreadable if not fresh.unreadable else None
        unproven = previous.unproven + fresh.unproven
        if unidentified:
            unproven.append(f"{unidentified} new process(es) whose stat could not be read")
        unproven = list(dict.fromkeys(unproven))[:MAX_UNPROVEN]  # scoped scans chain: no growth
        out = Owners(unreadable=unreadable, unverifiable=unverifiable, unproven=unproven,
                     scanned=previous.scanned, processes=processes, pod_of=pod_of)
        for key, hs in previous.holdings.items():
            kept = [h for h in hs if h.pid not in replaced]
            if kept:
                out.holdings[key] = kept
        for key, hs in fresh.holdings.items():
            out.holdings.setdefault(key, []).extend(hs)
        out.comms = {pid: c for pid, c in previous.comms.items() if pid not in replaced}
        out.comms.update(fresh.comms)
        out.holders = {pid: p for pid, p in previous.holders.items() if pid not in replaced}
        out.holders.update(fresh.holders)
        return out

    def _learn_mount_ids(self, processes: List[Process], devs: Set[int], again: bool = True) -> None:
        """Every namespace's watched mount IDs, before any fd is looked at. An fd passed from
        another namespace (SCM_RIGHTS between a pod's containers, a file opened through
        /proc/<pid>/root) is on a mount its holder's own mountinfo does not list; mount IDs are
        unique across namespaces, so the union of all of them still tells it is ours.
        `again=False` (a pod-scoped scan, the same watched devices): only `processes` (the new
        ones) are added to what the last scan learnt; a new tmpfs is a new device."""
        if again:
            self._ns_mounts = {}
            self._ns_of = {}
            self._all_mount_ids = set()
            self._learned_devs = set(devs)
        for proc in processes:
            self._all_mount_ids |= self._watched_mount_ids(proc.pid, devs) or set()

    def _forget_mount_ids(self, gone: Set[int]) -> None:
        """Drop the namespaces no process is left in, and their mount IDs from the union."""
        left = {self._ns_of.pop(pid) for pid in gone if pid in self._ns_of} - set(self._ns_of.values())
        if not left:
            return
        for namespace in left:
            self._ns_mounts.pop(namespace, None)
        self._all_mount_ids = set().union(*(ids for ids in self._ns_mounts.values() if ids))

    def _watched_mount_ids(self, pid: int, devs: Set[int]) -> Optional[Set[int]]:
        """IDs of the mounts of watched devices in the process's mount namespace (read once
        per namespace and scan); None when we may not read its mountinfo. Mount IDs are unique
        across namespaces; an fd passed in from another namespace (SCM_RIGHTS) is on a mount
        its own mountinfo does not list, and is not looked at."""
        try:
            namespace = os.readlink(self.table.paths.proc(pid, "ns", "mnt"))
        except OSError:
            namespace = f"pid:{pid}"  # its own entry, forgotten with it
        self._ns_of[pid] = namespace
        if namespace in self._ns_mounts:
            return self._ns_mounts[namespace]
        try:
            text = read_text(self.table.paths.proc(pid, "mountinfo"))
        except OSError as err:
            return None if _denied(err) else set()  # gone (or a fixture without one): no fds
        ids: Set[int] = set()
        for line in text.splitlines():
            fields = line.split(" ", 3)
            try:
                major, minor = fields[2].split(":")
                if os.makedev(int(major), int(minor)) in devs:
                    ids.add(int(fields[0]))
            except (IndexError, ValueError):
                continue
        self._ns_mounts[namespace] = ids
        return ids

    @staticmethod
    def _on_watched_mount(fdinfo: str, mount_ids: Set[int]) -> bool:
        """Whether an fd is on a watched mount, from fdinfo's mnt_id: never a stat, which on a
        hung FUSE or NFS file blocks for good. Kernels before 3.15 have no mnt_id: stat then."""
        try:
            handle = os.open(fdinfo, os.O_RDONLY)
        except OSError:
            return False  # closed since listdir
        try:
            info = os.read(handle, 4096)  # pos, flags, mnt_id, ino come first; raw: thousands per scan
        except OSError:
            return False
        finally:
            os.close(handle)
        at = info.find(b"mnt_id:")
        if at == -1:
            return True
        end = info.find(b"\n", at)
        try:
            return int(info[at + 7:end if end != -1 else len(info)]) in mount_ids
        except ValueError:
            return False

    def _started_since(self, seen: Set[int]) -> List[Process]:
        try:
            new = [pid for pid in self.table.pids() if pid not in seen]
        except OSError:
            return []
        found = []
        for pid in new:
            try:
                ident = self.table.identify(pid)
            except (OSError, ValueError, IndexError):
                continue  # counted as unreadable by the next walk; this one is short-lived
            if ident is not None and not ident[1]:
                found.append(ident[0])
        return found

    def _scan_process(self, proc: Process, devs: Set[int], tokens: Dict[str, int], out: Owners) -> None:
        out.scanned += 1
        held, denied = self._scan_one(proc, devs, tokens, out)
        if denied:
            if out.unreadable is not None:
                out.unreadable += 1
            # Excused only when root's: any process can name itself anything (PR_SET_NAME).
            excused = (self.ignore_unreadable is not None and proc.uid == 0
                       and self.ignore_unreadable.search(proc.comm))
            if not excused:
                if out.unverifiable is not None:
                    out.unverifiable += 1
                out.unproven_because(f"{proc.comm} (pid {proc.pid}, uid {proc.uid})")
        if held:
            # comm read after the maps, not from the walk: a holder that exec'ed in
            # between (sh -> ucx_perftest) is named by what it is now.
            comm = self.table.comm(proc.pid)
            out.comms[proc.pid] = proc.comm if comm == "unknown" else comm
            out.holders[proc.pid] = proc

    def _scan_one(self, proc: Process, devs: Set[int], tokens: Dict[str, int], out: Owners) -> Tuple[bool, bool]:
        """-> (holds something on a watched mount, some of its /proc entries were denied)."""
        pid = proc.pid
        denied = held_here = False
        try:
            for dev, inode, path, extent, map_range in parse_maps(self.table.maps(pid), tokens):
                held_here = True
                self._add(out.holdings, (dev, inode), pid, path, path.endswith(DELETED), extent=extent,
                          map_range=map_range)
        except OSError as err:
            denied |= _denied(err)
        fd_dir = self.table.fd_dir(pid)
        mount_ids = self._watched_mount_ids(pid, devs)
        fds: List[str] = []
        if mount_ids is None:
            denied = True  # without its mountinfo we cannot tell which fds are safe to stat
        elif mount_ids or self._all_mount_ids:  # an fd may come from another namespace's mount
            try:
                fds = os.listdir(fd_dir)
            except OSError as err:
                denied |= _denied(err)
        info_dir = self.table.paths.proc(pid, "fdinfo")
        ours = self._all_mount_ids | (mount_ids or set())
        for fd in fds:
            link = f"{fd_dir}/{fd}"  # not os.path.join: thousands per scan
            try:
                target = os.readlink(link)
                if not target.startswith("/"):
                    continue  # socket:[…], pipe:[…], anon_inode:…
                if not self._on_watched_mount(f"{info_dir}/{fd}", ours):
                    continue
                st = os.stat(link)  # the open file itself, known to be on a watched tmpfs
            except OSError:
                continue
            if st.st_dev in devs and stat_mod.S_ISREG(st.st_mode):
                held_here = True
                self._add(out.holdings, (st.st_dev, st.st_ino), pid, target, target.endswith(DELETED),
                          allocated=st.st_blocks * 512, apparent=st.st_size, mtime=st.st_mtime)
        return held_here, denied

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
                    st = os.stat(self.table.map_file(h.pid, h.map_range))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) == key:
                    h.allocated, h.apparent, h.mtime = st.st_blocks * 512, st.st_size, st.st_mtime
                    break
