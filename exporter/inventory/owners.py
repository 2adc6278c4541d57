"""Who maps or holds open which inode of the watched mounts, and which memfd: one pass over
/proc, joined with the listing by (device, inode), never by path text. Held but unlinked is a
hidden segment, which `df` counts and `ls` does not (NCCL >= 2.19, UCX, torch). A memfd region
is shmem no mount shows; its holders' memory cgroups are read to subtract it from their shmem."""

import os
from contextlib import suppress
from stat import S_ISREG
from typing import AbstractSet, Dict, Iterable, List, Mapping, Optional, Pattern
from typing import Sequence, Set, Tuple, TypeVar

from exporter.host.proctable import PidCounts, Process, ProcessTable, pids_wrapped
from exporter.inventory.holdings import MAX_UNPROVEN, Holding, Owners, Sizes
from exporter.inventory.holdings import unlinked_size
from exporter.host.paths import OUT_OF_RESOURCES
from exporter.inventory.maps import DELETED, NO_MNT_ID, DeviceTokens
from exporter.inventory.maps import MapsLine, unread
from exporter.inventory.maps import WatchedMountIds, dev_token, memfd_name, parse_maps
from exporter.inventory.maps import parse_memfd
from exporter.inventory.walk import Key
from exporter.model.classes import classify
from exporter.model.types import MemfdTotals, Segment

MAX_MEMFDS = 64  # memfds kept one by one per process; the rest by class (maybe 1000s)
MAX_PASSES = 4  # passes over new processes: a holder may fork and exit mid-scan
NO_WORKLOAD = "the workload's processes: none visible (a PID namespace of its own)"


class OwnerScan:
    """One pass over /proc: every process's maps and fds joined with the watched devices
    (`scan`), or node mode's refresh of new processes and some pods' (`refresh`)."""

    def __init__(
        self, table: ProcessTable, ignore_unreadable: Optional[Pattern[str]] = None
    ) -> None:
        self.table = table
        self.ignore_unreadable = ignore_unreadable
        self._mount_ids = WatchedMountIds(table.paths)
        self._kernel_threads: Set[int] = set()  # a refresh need not identify them again
        self._proc_root = table.paths.procfs.rstrip("/")
        self._pid_counts: Optional[PidCounts] = None  # at the last scan or refresh
        self._cgroup_of: Dict[
            Tuple[int, Optional[int]], str
        ] = {}  # (pid, start) -> cgroup

    # --- a full scan --------------------------------------------------------------------

    def scan(self, devs: Set[int], pods: bool = False) -> Owners:
        # A refresh trusts what it knows of a pid until pids wrap: from here on.
        self._pid_counts = self.table.pid_counts()
        walked = self.table.walk()
        unread, hidden = walked.unreadable, walked.invisible
        # Whoever we could not even identify, or cannot see, could hold anything.
        counted = None if hidden is None else unread + hidden
        out = Owners(unreadable=counted, unverifiable=counted)
        if unread:
            out.unproven_because(f"{unread} process(es) whose stat could not be read")
        if hidden is None:
            out.unproven_because("hidden processes (hidepid), uncounted")
        elif hidden:
            out.unproven_because(f"{hidden} process(es) hidden by hidepid")
        out.processes = {p.pid: p for p in walked.processes}
        self._mount_ids.learn(walked.processes, devs)
        self._scan_until_no_new_process(walked.processes, devs, out)
        out.folded = set()
        # A holder in shmwatch's own container is the workload too (check in the server's).
        if not (hidden is None or walked.workload_visible or out.hold_any(devs)):
            out.unreadable = out.unverifiable = None
            out.unproven_because(NO_WORKLOAD)
        # Node mode: holders' pods, for the inventory and for refresh() once they exit.
        if pods:
            out.pod_of = {pid: self.table.pod_uid(p) for pid, p in out.holders.items()}
        return out

    def _scan_until_no_new_process(
        self, processes: List[Process], devs: Set[int], out: Owners
    ) -> None:
        """Reads `processes`, then those started meanwhile, for at most MAX_PASSES passes."""
        for _ in range(MAX_PASSES):
            self._scan(processes, devs, out)
            new: Set[int] = set()
            with suppress(OSError):
                new = set(self.table.pids()) - out.processes.keys()
            processes = self.table.identify_all(new, self._kernel_threads).processes
            if not processes:
                return
            out.processes.update({p.pid: p for p in processes})
        out.unverifiable = None  # processes kept appearing: some were never read
        out.unproven_because(f"processes kept starting over {MAX_PASSES} passes")

    # --- node mode's refresh ------------------------------------------------------------

    def refresh(
        self, devs: Set[int], previous: Owners, also: AbstractSet[str] = frozenset()
    ) -> Optional[Owners]:
        """Node mode between full scans: read new processes, and the pods of holders that
        exited and of `also`; the others' holdings carry over (never orphan unread; gone
        processes are dropped only in scope). None when that cannot be scoped (a holder
        outside any pod exited, or pids wrapped): scan in full."""
        last, self._pid_counts = self._pid_counts, self.table.pid_counts()
        if pids_wrapped(last, self._pid_counts):
            return None
        try:
            alive = set(self.table.pids())
        except OSError:
            return None
        pods = _pods_to_read(devs, previous, alive, also)
        if pods is None:
            return None
        known = previous.processes.keys()
        gone = known - alive
        self._kernel_threads &= alive
        new = self.table.identify_all(alive - known, self._kernel_threads)
        born = {p.pid: p for p in new.processes}
        processes = _replaced(previous.processes, gone, born)
        pod_of = self._pods_of(previous, processes, born, bool(pods))
        scope = [p for i, p in processes.items() if i in born or pod_of.get(i) in pods]
        self._learn_mount_ids(devs, gone, new.processes, processes)
        # one unread could hold anything: the count is absent until a full scan, as when denied
        fresh = Owners(unreadable=new.unreadable, unverifiable=new.unreadable)
        self._scan(scope, devs, fresh)
        if new.unreadable:
            fresh.unproven_because(
                f"{new.unreadable} new process(es) whose stat could not be read"
            )
        replaced = {pid for pid, pod in previous.pod_of.items() if pod in pods}
        replaced |= {p.pid for p in scope}
        return _carried_over(previous, fresh, replaced, processes, pod_of)

    def _pods_of(
        self,
        previous: Owners,
        processes: Dict[int, Process],
        born: Dict[int, Process],
        reading_pods: bool,
    ) -> Dict[int, str]:
        """pid -> pod UID of the processes a refresh knows. A holder that exited keeps its
        pod while its holdings carry over, so the next scan of its pod drops them. A pid
        handed on is new."""
        stale = previous.pod_of.keys() - processes.keys() - previous.holders.keys()
        pod_of = _replaced(previous.pod_of, stale | born.keys())
        unknown = processes.keys() - pod_of.keys() if reading_pods else born.keys()
        pod_of.update({pid: self.table.pod_uid(processes[pid]) for pid in unknown})
        return pod_of

    def _learn_mount_ids(
        self,
        devs: Set[int],
        gone: AbstractSet[int],
        new: List[Process],
        processes: Dict[int, Process],
    ) -> None:
        if devs == self._mount_ids.learned_devs:
            self._mount_ids.forget(set(gone))
            self._mount_ids.learn(new, devs, again=False)
        else:  # a watched mount came or went
            self._mount_ids.learn(processes.values(), devs)

    # --- memfd regions ------------------------------------------------------------------

    def memfd_regions(self, owners: Owners) -> Tuple[List[Segment], Dict[int, str]]:
        """(the regions held one by one, the memory cgroup of each holder of those and of
        those counted by class: read once per pid and start time)."""
        regions = []
        for key, hs in owners.holdings.items():
            if (name := memfd_name(hs[0].path)) is not None:
                regions.append(_memfd_region(name, key, hs))
        out: Dict[int, str] = {}
        known: Dict[Tuple[int, Optional[int]], str] = {}
        for pid in {p for r in regions for p in r.holders} | owners.memfd_rest.keys():
            proc = owners.holders.get(pid)
            ident = (pid, proc.start_time if proc else None)
            path = self._cgroup_of.get(ident)
            if path is None:
                path = self._memory_cgroup(pid)
            if path is not None:
                out[pid] = known[ident] = path
        self._cgroup_of = known
        return regions, out

    def _memory_cgroup(self, pid: int) -> Optional[str]:
        try:
            cgroups = self.table.cgroups(pid)
        except OSError:
            return None
        return cgroups.get("memory", cgroups.get(""))

    # --- one process --------------------------------------------------------------------

    def _scan(self, processes: Sequence[Process], devs: Set[int], out: Owners) -> None:
        tokens = DeviceTokens({dev_token(d): d for d in devs})
        for proc in processes:
            self._scan_one(proc, devs, tokens, out)
        self._fill_mapping_sizes(out.holdings)

    def _scan_one(
        self, proc: Process, devs: Set[int], tokens: DeviceTokens, out: Owners
    ) -> None:
        """What one process maps and holds open on the watched devices, and its memfds."""
        pid, mounted = proc.pid, self._mount_ids
        # Its namespace now, not as learn() found it: it may have entered another since.
        mount_ids = mounted.of(pid, devs)
        memfds = Owners()  # this process's, bounded before they join `out`
        maps = self._maps(pid)
        # No mountinfo: no telling fds safe to stat, nor memfds from files at /memfd:x.
        denied = mount_ids is None or maps is None
        for line in parse_maps(maps or "", tokens):
            out.hold(line.key, _mapped(pid, line))
        for line in [] if denied else parse_memfd(maps or "", mounted.mounted_devs):
            memfds.hold(line.key, _mapped(pid, line))
        if mount_ids is not None:
            fds = self._fds(pid, mount_ids)
            denied |= fds is None
            self._hold_fds(pid, fds or [], devs, mount_ids, out, memfds)
        held_here = pid in out.keys_of or bool(memfds.holdings)
        self._fold_memfds(pid, memfds.holdings, out)
        out.scanned += 1
        if denied:
            self._count_denied(proc, out)
        if held_here:
            self._name_holder(proc, out)

    def _name_holder(self, proc: Process, out: Owners) -> None:
        """A holder by its comm read after its maps: one that exec'ed since is named anew."""
        comm = self.table.comm(proc.pid)
        out.comms[proc.pid] = proc.comm if comm == "unknown" else comm
        out.holders[proc.pid] = proc

    def _maps(self, pid: int) -> Optional[str]:
        """Its maps; None: denied (another UID, hidepid); '' when gone. Out of fds or
        memory fails the scan: taken for gone, it would call what the process holds
        leaked."""
        try:
            return self.table.maps(pid)
        except OSError as err:
            return unread(err, gone="")

    def _fds(self, pid: int, mount_ids: Set[int]) -> Optional[List[str]]:
        """Its fd numbers, with its mountinfo read (an fd may come from another namespace's
        mount); [] when none can be on a watched mount or it is gone; None: denied. Out of
        fds or memory fails the scan, as `_maps` says."""
        if not (mount_ids or self._mount_ids.union):
            return []
        try:
            # not Paths.proc: thousands a scan
            return os.listdir(f"{self._proc_root}/{pid}/fd")
        except OSError as err:
            return unread(err, gone=[])

    def _hold_fds(
        self,
        pid: int,
        fds: List[str],
        devs: Set[int],
        mount_ids: Set[int],
        out: Owners,
        memfds: Owners,
    ) -> None:
        """The open files themselves, each known to be on a watched tmpfs or a memfd before
        it is stat'ed: an fd on any other mount (a hung FUSE or NFS) never is. One loop,
        names bound once: a node's scan reads 100,000 fds."""
        mounted, proc_dir = self._mount_ids, f"{self._proc_root}/{pid}"
        for fd in fds:
            link = f"{proc_dir}/fd/{fd}"
            try:
                target = os.readlink(link)
                if not target.startswith("/"):
                    continue  # socket:[…], pipe:[…], anon_inode:…
                mnt = mounted.fd_mount(f"{proc_dir}/fdinfo/{fd}")
                # A memfd is on the kernel's internal shm mount, in no mountinfo.
                memfd = mnt not in mounted.mounted_ids and mnt not in (None, NO_MNT_ID)
                memfd = memfd and memfd_name(target) is not None
                ours = mnt in mounted.union or mnt in mount_ids
                if not (memfd or ours or mnt == NO_MNT_ID):
                    continue
                st = os.stat(link)
            except OSError as err:
                _closed_or_raise(err)
                continue
            if (memfd or st.st_dev in devs) and S_ISREG(st.st_mode):
                deleted = target.endswith(DELETED)
                held = Holding(pid=pid, path=target, deleted=deleted, sizes=_sizes(st))
                (memfds if memfd else out).hold((st.st_dev, st.st_ino), held)

    def _fold_memfds(
        self, pid: int, regions: Dict[Key, List[Holding]], out: Owners
    ) -> None:
        """A process's memfd regions into `out`: its MAX_MEMFDS largest one by one, the rest
        as counts and bytes by class. A region folded counts once: in the totals of the first
        process that holds it."""
        if len(regions) > MAX_MEMFDS:
            self._fill_mapping_sizes(regions)  # the bytes folded are final
            order = sorted(
                regions, key=lambda k: (-unlinked_size(regions[k]).allocated_bytes, k)
            )
            rest: Dict[str, MemfdTotals] = {}
            for key in order[MAX_MEMFDS:]:
                hs = regions.pop(key)
                if key in out.holdings or key in out.folded:
                    continue
                out.folded.add(key)
                cls = classify(memfd_name(hs[0].path) or "")
                was = rest.get(cls, MemfdTotals(count=0, allocated_bytes=0))
                rest[cls] = MemfdTotals(
                    count=was.count + 1,
                    allocated_bytes=was.allocated_bytes
                    + unlinked_size(hs).allocated_bytes,
                )
            out.memfd_rest[pid] = rest
        for key, (h,) in regions.items():
            if key not in out.folded:
                out.hold(key, h)

    def _count_denied(self, proc: Process, out: Owners) -> None:
        """A process whose maps or fds we may not read could hold anything; excused only
        when root's and its whole name (comm) matches --segments.ignore-unreadable, anchored
        as the metric lists are: a regex searched would excuse any root process whose name
        merely contains it (any process can name itself anything: PR_SET_NAME)."""
        if out.unreadable is not None:
            out.unreadable += 1
        excuse = self.ignore_unreadable
        if proc.uid == 0 and excuse is not None and excuse.fullmatch(proc.comm):
            return
        if out.unverifiable is not None:
            out.unverifiable += 1
        out.unproven_because(f"{proc.comm} (pid {proc.pid}, uid {proc.uid})")

    def _fill_mapping_sizes(self, holdings: Dict[Key, List[Holding]]) -> None:
        """Deleted inodes held only by a mapping: stat through map_files (CAP_SYS_ADMIN);
        without it the mapping's extent stands in for the size."""
        for key, hs in holdings.items():
            if any(h.sizes for h in hs) or not any(h.deleted for h in hs):
                continue
            for h in filter(lambda h: h.map_range, hs):
                with suppress(OSError):
                    st = os.stat(self.table.paths.proc(h.pid, "map_files", h.map_range))
                    if (st.st_dev, st.st_ino) == key:
                        h.sizes = _sizes(st)
                        break


def _closed_or_raise(err: OSError) -> None:
    """An fd's read that failed: raised when out of fds or memory, failing the scan (it says
    nothing of what the fd holds); else it returns (the fd was closed since, or is denied)."""
    if err.errno in OUT_OF_RESOURCES:
        raise err


def _pods_to_read(
    devs: Set[int], previous: Owners, alive: AbstractSet[int], also: AbstractSet[str]
) -> Optional[Set[str]]:
    """The pods a refresh reads again: `also`, and those of holders that exited; None when a
    holder outside any pod exited (a memfd alone, as runc's, waits for the next full scan)."""
    pods = set(also)
    for pid in previous.holders.keys() - alive:
        if pod := previous.pod_of.get(pid):
            pods.add(pod)
        elif any(key[0] in devs for key in previous.keys_of.get(pid, ())):
            return None
    return pods


def _carried_over(
    previous: Owners,
    fresh: Owners,
    replaced: Set[int],
    processes: Dict[int, Process],
    pod_of: Dict[int, str],
) -> Owners:
    """`previous` with the holdings of the `replaced` pids replaced by `fresh`'s."""
    # The lists are shared with `previous`: those touched are made anew, never edited.
    holdings = dict(previous.holdings)
    for key in {key for pid in replaced for key in previous.keys_of.get(pid, ())}:
        if kept := [h for h in holdings[key] if h.pid not in replaced]:
            holdings[key] = kept
        else:
            del holdings[key]
    for key, hs in fresh.holdings.items():
        holdings[key] = holdings.get(key, []) + hs
    # Refreshes chain: the reasons are deduplicated and bounded.
    unproven = dict.fromkeys(previous.unproven + fresh.unproven)
    return Owners(
        holdings=holdings,
        comms=_replaced(previous.comms, replaced, fresh.comms),
        holders=_replaced(previous.holders, replaced, fresh.holders),
        unreadable=None if fresh.unreadable else previous.unreadable,
        unverifiable=None if fresh.unverifiable else previous.unverifiable,
        unproven=list(unproven)[:MAX_UNPROVEN],
        scanned=previous.scanned,
        processes=processes,
        keys_of=_replaced(previous.keys_of, replaced, fresh.keys_of),
        pod_of=pod_of,
        memfd_rest=_replaced(previous.memfd_rest, replaced, fresh.memfd_rest),
    )


def _mapped(pid: int, line: MapsLine) -> Holding:
    return Holding(
        pid=pid,
        path=line.path,
        deleted=line.path.endswith(DELETED),
        extent=line.extent,
        map_range=line.map_range,
    )


def _memfd_region(name: str, key: Key, hs: List[Holding]) -> Segment:
    size = unlinked_size(hs)
    return Segment(
        name=name,
        cls=classify(name),
        state="hidden",
        allocated_bytes=size.allocated_bytes,
        apparent_bytes=size.apparent_bytes,
        mtime=size.mtime,
        holders=tuple(sorted({h.pid for h in hs})),
        key=key,
    )


def _sizes(st: os.stat_result) -> Sizes:
    """st_blocks x 512 is what tmpfs charges."""
    return Sizes(
        allocated_bytes=st.st_blocks * 512,
        apparent_bytes=st.st_size,
        mtime=st.st_mtime,
    )


K = TypeVar("K")
V = TypeVar("V")


def _replaced(
    old: Mapping[K, V], gone: Iterable[K], new: Optional[Mapping[K, V]] = None
) -> Dict[K, V]:
    """`old` - `gone` + `new`: copied in C, then edited, so a refresh is O(pod) in Python."""
    out = dict(old)
    for key in gone:
        out.pop(key, None)
    out.update(new or {})
    return out
