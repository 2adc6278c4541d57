"""Who maps or holds open which inode of the watched mounts, and which memfd: one pass over
/proc, joined with the listing by (device, inode), never by path text. Held but unlinked is a
hidden segment, which `df` counts and `ls` does not (NCCL >= 2.19, UCX, torch). A memfd region
is shmem no mount shows; its holders' memory cgroups are read to subtract it from their shmem."""

import os
from contextlib import suppress
from stat import S_ISREG
from typing import Dict, Iterable, List, Optional, Pattern, Sequence, Set, Tuple

from exporter.host.proctable import PidCounts, Process, ProcessTable, pids_wrapped
from exporter.inventory.holdings import MAX_UNPROVEN, Holding, Owners, unlinked_size
from exporter.inventory.maps import DELETED, DENIED, NO_MNT_ID, DeviceTokens, dev_token
from exporter.inventory.maps import WatchedMountIds, memfd_name, parse_maps, parse_memfd
from exporter.inventory.walk import Key
from exporter.model.classes import classify
from exporter.model.types import Segment

MAX_MEMFDS = 64  # memfds kept one by one per process; the rest by class (maybe 1000s)
MAX_PASSES = 4  # passes over new processes: a holder may fork and exit mid-scan


class OwnerScan:
    def __init__(self, table: ProcessTable, ignore_unreadable=None):
        self.table = table
        self.ignore_unreadable: Optional[Pattern[str]] = ignore_unreadable
        self._mount_ids = WatchedMountIds(table.paths)
        self._kernel_threads: Set[int] = set()  # a refresh need not identify them again
        self._proc_root = table.paths.procfs.rstrip("/")
        self._pid_counts: PidCounts = None  # at the last scan or refresh
        self._cgroup_of: Dict[tuple, str] = {}  # (pid, start time) -> memory cgroup

    def scan(self, devs: Set[int], pods: bool = False) -> Owners:
        # A refresh trusts what it knows of a pid until pids wrap: from here on.
        self._pid_counts = self.table.pid_counts()
        walked = self.table.walk()
        unread, hidden = walked.unreadable, walked.invisible
        # Whoever we could not even identify, or cannot see, could hold anything.
        counted = unread + (hidden or 0)
        out = Owners(unreadable=counted, unverifiable=counted)
        if unread:
            out.unproven_because(f"{unread} process(es) whose stat could not be read")
        if hidden is None or not walked.workload_visible:
            out.unreadable = out.unverifiable = None
            out.unproven_because(
                "hidden processes (hidepid), uncounted"
                if hidden is None
                else "the workload's processes: only shmwatch and its parents are visible "
                "(a PID namespace of its own)"
            )
        elif hidden:
            out.unproven_because(f"{hidden} process(es) hidden by hidepid")
        processes = walked.processes
        out.processes = {p.pid: p for p in processes}
        self._mount_ids.learn(processes, devs)
        for _ in range(MAX_PASSES):
            self._scan(processes, devs, out)
            new = set()
            with suppress(OSError):
                new = set(self.table.pids()) - out.processes.keys()
            processes = self.table.identify_all(new, self._kernel_threads)[0]
            if not processes:
                break
            out.processes.update({p.pid: p for p in processes})
        else:
            out.unverifiable = None  # processes kept appearing: some were never read
            out.unproven_because(f"processes kept starting over {MAX_PASSES} passes")
        out.folded = set()
        # Node mode: holders' pods, for the inventory and for refresh() once they exit.
        if pods:
            out.pod_of = {pid: self.table.pod_uid(p) for pid, p in out.holders.items()}
        return out

    def refresh(
        self, devs: Set[int], previous: Owners, also: Set[str] = frozenset()
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
        pods = set(also)
        for pid in previous.holders.keys() - alive:
            if pod := previous.pod_of.get(pid):
                pods.add(pod)
            elif any(key[0] in devs for key in previous.keys_of.get(pid, ())):
                return None  # (a memfd alone, as runc's, waits for the next full scan)
        known = previous.processes.keys()
        gone = known - alive
        self._kernel_threads &= alive
        new, unidentified = self.table.identify_all(alive - known, self._kernel_threads)
        born = {p.pid: p for p in new}
        processes = _replaced(previous.processes, gone, born)
        # A holder that exited keeps its pod while its holdings carry over, so the next scan
        # of its pod drops them. A pid handed on is new.
        stale = previous.pod_of.keys() - processes.keys() - previous.holders.keys()
        pod_of = _replaced(previous.pod_of, stale | born.keys())
        unknown = processes.keys() - pod_of.keys() if pods else born
        pod_of.update({pid: self.table.pod_uid(processes[pid]) for pid in unknown})
        scope = [p for i, p in processes.items() if i in born or pod_of.get(i) in pods]
        if devs == self._mount_ids.learned_devs:
            self._mount_ids.forget(gone)
            self._mount_ids.learn(new, devs, again=False)
        else:  # a watched mount came or went
            self._mount_ids.learn(processes.values(), devs)
        fresh = Owners(unreadable=unidentified, unverifiable=unidentified)
        self._scan(scope, devs, fresh)
        if unidentified:
            fresh.unproven_because(
                f"{unidentified} new process(es) whose stat could not be read"
            )
        replaced = {pid for pid, pod in previous.pod_of.items() if pod in pods}
        replaced |= {p.pid for p in scope}
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
            holdings,
            unreadable=None if fresh.unreadable else previous.unreadable,
            unverifiable=None if fresh.unverifiable else previous.unverifiable,
            unproven=list(unproven)[:MAX_UNPROVEN],
            scanned=previous.scanned,
            processes=processes,
            pod_of=pod_of,
            **{
                n: _replaced(getattr(previous, n), replaced, getattr(fresh, n))
                for n in ("keys_of", "comms", "holders", "memfd_rest")
            },
        )

    def memfd_regions(self, owners: Owners) -> Tuple[List[Segment], Dict[int, str]]:
        """(the regions held one by one, the memory cgroup of each holder of those and of
        those counted by class: read once per pid and start time)."""
        regions = []
        for key, hs in owners.holdings.items():
            if (name := memfd_name(hs[0].path)) is not None:
                held = (*unlinked_size(hs), tuple(sorted({h.pid for h in hs})))
                regions.append(Segment(name, classify(name), "hidden", *held, key))
        out, known = {}, {}
        for pid in {p for r in regions for p in r.holders} | owners.memfd_rest.keys():
            proc = owners.holders.get(pid)
            ident = (pid, proc.start_time if proc else None)
            if (path := self._cgroup_of.get(ident)) is None:
                with suppress(OSError):
                    cgroups = self.table.cgroups(pid)
                    path = cgroups.get("memory", cgroups.get(""))
            if path is not None:
                out[pid] = known[ident] = path
        self._cgroup_of = known
        return regions, out

    def _scan(self, processes: Sequence[Process], devs: Set[int], out: Owners) -> None:
        tokens = DeviceTokens({dev_token(d): d for d in devs})
        for proc in processes:
            self._scan_one(proc, devs, tokens, out)
        self._fill_mapping_sizes(out.holdings)

    def _scan_one(self, proc: Process, devs: Set[int], tokens, out: Owners) -> None:
        pid, mounted = proc.pid, self._mount_ids
        # Its namespace now, not as learn() found it: it may have entered another since.
        mount_ids = mounted.of(pid, devs)
        # No mountinfo: no telling fds safe to stat, nor memfds from files at /memfd:x.
        denied = mount_ids is None
        memfds = Owners()  # this process's, bounded before they join `out`
        text = ""
        try:
            text = self.table.maps(pid)
        except OSError as err:
            denied |= err.errno in DENIED
        found = [] if denied else parse_memfd(text, mounted.mounted_devs)
        for into, lines in ((out, parse_maps(text, tokens)), (memfds, found)):
            for dev, inode, path, extent, span in lines:
                held = Holding(pid, path, path.endswith(DELETED), extent, span)
                into.hold((dev, inode), held)
        fd_dir = f"{self._proc_root}/{pid}/fd"  # not Paths.proc: thousands per scan
        fds: List[str] = []
        # With its mountinfo read (an fd may come from another namespace's mount).
        if mount_ids is not None and (mount_ids or mounted.union):
            try:
                fds = os.listdir(fd_dir)
            except OSError as err:
                denied |= err.errno in DENIED
        for fd in fds:
            link = f"{fd_dir}/{fd}"
            try:
                target = os.readlink(link)
                if not target.startswith("/"):
                    continue  # socket:[…], pipe:[…], anon_inode:…
                mnt = mounted.fd_mount(f"{self._proc_root}/{pid}/fdinfo/{fd}")
                # A memfd is on the kernel's internal shm mount, in no mountinfo.
                memfd = mnt not in mounted.mounted_ids and mnt not in (None, NO_MNT_ID)
                memfd = memfd and memfd_name(target) is not None
                ours = mnt in mounted.union or mnt in mount_ids
                if not (memfd or ours or mnt == NO_MNT_ID):
                    continue
                # The open file itself, known to be on a watched tmpfs or a memfd.
                st = os.stat(link)
            except OSError:
                continue
            if (memfd or st.st_dev in devs) and S_ISREG(st.st_mode):
                held = Holding(pid, target, target.endswith(DELETED), 0, "", _sizes(st))
                (memfds if memfd else out).hold((st.st_dev, st.st_ino), held)
        held_here = pid in out.keys_of or bool(memfds.holdings)
        # A region folded counts once: in the totals of the first process that holds it.
        regions = memfds.holdings
        if len(regions) > MAX_MEMFDS:
            self._fill_mapping_sizes(regions)  # the bytes folded are final
            order = sorted(regions, key=lambda k: (-unlinked_size(regions[k])[0], k))
            rest: Dict[str, Tuple[int, int]] = {}
            for key in order[MAX_MEMFDS:]:
                hs = regions.pop(key)
                if key in out.holdings or key in out.folded:
                    continue
                out.folded.add(key)
                count, size = rest.get(cls := classify(memfd_name(hs[0].path)), (0, 0))
                rest[cls] = count + 1, size + unlinked_size(hs)[0]
            out.memfd_rest[pid] = rest
        for key, (h,) in regions.items():
            if key not in out.folded:
                out.hold(key, h)
        out.scanned += 1
        if denied and out.unreadable is not None:
            out.unreadable += 1
        # Excused only when root's: any process can name itself anything (PR_SET_NAME).
        excused = self.ignore_unreadable and proc.uid == 0
        if denied and not (excused and self.ignore_unreadable.search(proc.comm)):
            if out.unverifiable is not None:
                out.unverifiable += 1
            out.unproven_because(f"{proc.comm} (pid {proc.pid}, uid {proc.uid})")
        if held_here:
            # comm read after the maps: a holder that exec'ed since is named anew.
            comm = self.table.comm(pid)
            out.comms[pid] = proc.comm if comm == "unknown" else comm
            out.holders[pid] = proc

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


def _sizes(st: os.stat_result) -> Tuple[int, int, float]:
    """(allocated, apparent, mtime): st_blocks x 512 is what tmpfs charges."""
    return st.st_blocks * 512, st.st_size, st.st_mtime


def _replaced(old: dict, gone: Iterable, new: Optional[dict] = None) -> dict:
    """`old` - `gone` + `new`: copied in C, then edited, so a refresh is O(pod) in Python."""
    out = dict(old)
    for key in gone:
        out.pop(key, None)
    out.update(new or ())
    return out
