"""Who maps or holds open which inode of the watched mounts, and which memfd: one pass over /proc.

Joined with the listing by (device, inode), never by path text. What is held but unlinked
is a hidden segment, which `df` counts and `ls` does not (NCCL >= 2.19, UCX, torch)."""

from __future__ import annotations

import os
import stat as stat_mod
from typing import Dict, List, Optional, Pattern, Sequence, Set, Tuple

from exporter.host.proctable import PidWrapWatch, Process, ProcessTable
from exporter.inventory.holdings import MAX_UNPROVEN, Holding, Owners, unlinked_size
from exporter.inventory.maps import DELETED, DeviceTokens, memfd_name
from exporter.inventory.maps import parse_maps, parse_memfd
from exporter.inventory.mount_ids import NO_MNT_ID, WatchedMountIds
from exporter.inventory.mount_ids import denied as denied_by
from exporter.inventory.walk import Key
from exporter.model.classes import classify

# memfd regions kept one by one per process (the largest); the rest by class: a tenant may
# open thousands.
MAX_MEMFDS = 64


class OwnerScan:
    """Reads the maps and fds of the processes the table lists."""

    def __init__(
        self, table: ProcessTable, ignore_unreadable: Optional[Pattern[str]] = None
    ):
        self.table = table
        self.ignore_unreadable = ignore_unreadable
        self._mount_ids = WatchedMountIds(table.paths)
        # Pids a scoped scan need not identify again.
        self._kernel_threads: Set[int] = set()
        # A refresh trusts what it knows of a pid until pids wrap.
        self._pid_wrap = PidWrapWatch(table)
        self._proc_root = table.paths.procfs.rstrip("/")

    # A holder may fork and exit mid-scan: processes new since a pass are read in another, up
    # to this many; still new ones after that leave the scan unproven.
    MAX_PASSES = 4

    def scan(self, devs: Set[int], pods: bool = False) -> Owners:
        self._pid_wrap.wrapped()  # from here on
        walked = self.table.walk()
        # Whoever we could not even identify could hold anything.
        out = Owners(unreadable=walked.unreadable, unverifiable=walked.unreadable)
        if walked.unreadable:
            out.unproven_because(
                f"{walked.unreadable} process(es) whose stat could not be read"
            )
        if walked.invisible is None or not walked.workload_visible:
            out.unreadable = out.unverifiable = None
            out.unproven_because(
                "hidden processes (hidepid), uncounted"
                if walked.invisible is None
                else "the workload's processes: only shmwatch and its parents are visible "
                "(a PID namespace of its own)"
            )
        elif walked.invisible:
            out.unreadable += walked.invisible
            out.unverifiable += walked.invisible
            out.unproven_because(f"{walked.invisible} process(es) hidden by hidepid")
        out.processes = {p.pid: p for p in walked.processes}
        self._mount_ids.learn(walked.processes, devs)
        processes = walked.processes
        for _ in range(self.MAX_PASSES):
            self._scan_processes(processes, devs, out)
            try:
                new = set(self.table.pids()) - out.processes.keys()
            except OSError:
                new = set()
            processes = self.table.identify_all(new, self._kernel_threads)[0]
            if not processes:
                break
            out.processes.update({p.pid: p for p in processes})
        else:
            out.unverifiable = None  # processes kept appearing: some were never read
            out.unproven_because(
                f"processes kept starting over {self.MAX_PASSES} passes"
            )
        self._fill_mapping_sizes(out.holdings)
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
        if self._pid_wrap.wrapped():
            return None
        try:
            alive = set(self.table.pids())
        except OSError:
            return None
        pods = set(also)
        for pid in previous.holders.keys() - alive:
            pod = previous.pod_of.get(pid)
            if pod:
                pods.add(pod)
            elif any(key[0] in devs for key in previous.keys_of.get(pid, ())):
                return None  # (a memfd alone, as runc's, waits for the next full scan)
        # Copies made in C, then edited: a quick run does O(pod) work in Python, not O(node).
        processes = dict(previous.processes)
        for pid in previous.processes.keys() - alive:
            del processes[pid]
        self._kernel_threads &= alive
        # A new process we cannot read (unidentified) could hold anything.
        new, unidentified = self.table.identify_all(
            alive - processes.keys(), self._kernel_threads
        )
        processes.update({p.pid: p for p in new})
        # Each process's pod, looked up once. A holder that exited keeps its pod while its
        # holdings carry over, so the next scan of its pod drops them. A pid handed on is new.
        pod_of = dict(previous.pod_of)
        for pid in pod_of.keys() - processes.keys() - previous.holders.keys():
            del pod_of[pid]
        for p in new:
            pod_of.pop(p.pid, None)
        if pods:
            unknown = {
                pid: self.table.pod_uid(processes[pid])
                for pid in processes.keys() - pod_of.keys()
            }
            pod_of.update(unknown)
            previous.pod_of.update(unknown)
        else:
            pod_of.update({p.pid: self.table.pod_uid(p) for p in new})
        scope = [
            p
            for pid, pod in pod_of.items()
            if pod in pods and (p := processes.get(pid)) is not None
        ]
        scope += [p for p in new if pod_of.get(p.pid) not in pods]
        fresh = Owners()
        if devs == self._mount_ids.learned_devs:
            self._mount_ids.forget(previous.processes.keys() - alive)
            self._mount_ids.learn(new, devs, again=False)
        else:  # a watched mount came or went
            self._mount_ids.learn(processes.values(), devs)
        self._scan_processes(scope, devs, fresh)
        self._fill_mapping_sizes(fresh.holdings)
        was_in_scope = {pid for pid, pod in previous.pod_of.items() if pod in pods}
        replaced = was_in_scope | {p.pid for p in scope}
        proven = not (fresh.unverifiable or unidentified)
        unproven = previous.unproven + fresh.unproven
        if unidentified:
            unproven.append(
                f"{unidentified} new process(es) whose stat could not be read"
            )
        out = Owners(
            unreadable=None if fresh.unreadable else previous.unreadable,
            unverifiable=previous.unverifiable if proven else None,
            # Scoped scans chain: no growth.
            unproven=list(dict.fromkeys(unproven))[:MAX_UNPROVEN],
            scanned=previous.scanned,
            processes=processes,
            pod_of=pod_of,
        )
        # The lists are shared with `previous`: those touched are made anew, never edited.
        out.holdings = dict(previous.holdings)
        for key in {key for pid in replaced for key in previous.keys_of.get(pid, ())}:
            kept = [h for h in out.holdings[key] if h.pid not in replaced]
            if kept:
                out.holdings[key] = kept
            else:
                del out.holdings[key]
        for key, hs in fresh.holdings.items():
            out.holdings[key] = out.holdings.get(key, []) + hs
        for name in ("keys_of", "comms", "holders", "memfd_rest"):  # by pid
            merged = dict(getattr(previous, name))
            for pid in replaced:
                merged.pop(pid, None)
            merged.update(getattr(fresh, name))
            setattr(out, name, merged)
        return out

    def _scan_processes(
        self, processes: Sequence[Process], devs: Set[int], out: Owners
    ) -> None:
        tokens = DeviceTokens.of(devs)
        for proc in processes:
            out.scanned += 1
            held, denied = self._scan_one(proc, devs, tokens, out)
            if denied and out.unreadable is not None:
                out.unreadable += 1
            # Excused only when root's: any process can name itself anything (PR_SET_NAME).
            if denied and not (
                self.ignore_unreadable is not None
                and proc.uid == 0
                and self.ignore_unreadable.search(proc.comm)
            ):
                if out.unverifiable is not None:
                    out.unverifiable += 1
                out.unproven_because(f"{proc.comm} (pid {proc.pid}, uid {proc.uid})")
            if held:
                # comm read after the maps: a holder that exec'ed since is named anew.
                comm = self.table.comm(proc.pid)
                out.comms[proc.pid] = proc.comm if comm == "unknown" else comm
                out.holders[proc.pid] = proc

    def _scan_one(
        self, proc: Process, devs: Set[int], tokens: Dict[str, int], out: Owners
    ) -> Tuple[bool, bool]:
        """-> (holds something on a watched mount, some of its /proc entries were denied)."""
        pid = proc.pid
        denied = held_here = False
        mounted = self._mount_ids
        # Its namespace now, not as learn() found it: it may have entered another since.
        mount_ids = mounted.of(pid, devs)
        memfds = Owners()  # this process's, bounded before they join `out`
        try:
            text = self.table.maps(pid)
            # Without its mountinfo a memfd cannot be told from a file at /memfd:x.
            found = [] if mount_ids is None else parse_memfd(text, mounted.mounted_devs)
            for into, lines in ((out, parse_maps(text, tokens)), (memfds, found)):
                for dev, inode, path, extent, map_range in lines:
                    held_here = True
                    deleted = path.endswith(DELETED)
                    held = Holding(pid, path, deleted, extent, map_range=map_range)
                    self._add(into, (dev, inode), held)
        except OSError as err:
            denied |= denied_by(err)
        fd_dir = f"{self._proc_root}/{pid}/fd"  # not Paths.proc: thousands per scan
        fds: List[str] = []
        if mount_ids is None:
            # Without its mountinfo we cannot tell which fds are safe to stat.
            denied = True
        elif mount_ids or mounted.union:
            # (an fd may come from another namespace's mount)
            try:
                fds = os.listdir(fd_dir)
            except OSError as err:
                denied |= denied_by(err)
        info_dir = f"{self._proc_root}/{pid}/fdinfo"
        union, mount_ids = mounted.union, mount_ids or ()
        for fd in fds:
            link = f"{fd_dir}/{fd}"
            try:
                target = os.readlink(link)
                if not target.startswith("/"):
                    continue  # socket:[…], pipe:[…], anon_inode:…
                mnt = mounted.fd_mount(f"{info_dir}/{fd}")
                # A memfd is on the kernel's internal shm mount, in no mountinfo.
                memfd = mnt not in mounted.mounted_ids and mnt not in (None, NO_MNT_ID)
                memfd = memfd and memfd_name(target) is not None
                ours = mnt in union or mnt in mount_ids
                if not (memfd or ours or mnt == NO_MNT_ID):
                    continue
                # The open file itself, known to be on a watched tmpfs or a memfd.
                st = os.stat(link)
            except OSError:
                continue
            if (memfd or st.st_dev in devs) and stat_mod.S_ISREG(st.st_mode):
                held_here = True
                deleted = target.endswith(DELETED)
                held = Holding(pid, target, deleted, 0, *_sizes(st))
                self._add(memfds if memfd else out, (st.st_dev, st.st_ino), held)
        self._keep_memfds(pid, memfds.holdings, out)
        return held_here, denied

    def _keep_memfds(self, pid: int, held: Dict[Key, List[Holding]], out: Owners):
        """A process's memfd regions join `out`: the MAX_MEMFDS largest one by one, the rest
        as counts and bytes by class. Each region counts once: one held by processes that
        fold it counts in the first read's totals only."""
        if len(held) > MAX_MEMFDS:
            self._fill_mapping_sizes(held)  # the bytes folded are final
            order = sorted(held, key=lambda key: (-unlinked_size(held[key])[0], key))
            rest: Dict[str, Tuple[int, int]] = {}
            for key in order[MAX_MEMFDS:]:
                hs = held.pop(key)
                if key in out.holdings or key in out.folded:
                    continue
                out.folded.add(key)
                count, size = rest.get(cls := classify(memfd_name(hs[0].path)), (0, 0))
                rest[cls] = count + 1, size + unlinked_size(hs)[0]
            out.memfd_rest[pid] = rest
        for key, (h,) in held.items():
            if key not in out.folded:
                self._add(out, key, h)

    @staticmethod
    def _add(out: Owners, key: Key, new: Holding) -> None:
        """Record `new`, merged into the process's hold on `key` if it has one already."""
        for h in out.holdings.setdefault(key, []):
            if h.pid == new.pid:
                h.extent = max(h.extent, new.extent)
                h.deleted |= new.deleted
                h.map_range = h.map_range or new.map_range
                if new.allocated is not None:
                    h.allocated = new.allocated
                    h.apparent = new.apparent
                    h.mtime = new.mtime
                return
        out.holdings[key].append(new)
        out.keys_of.setdefault(new.pid, []).append(key)

    def _fill_mapping_sizes(self, holdings: Dict[Key, List[Holding]]) -> None:
        """Deleted inodes held only by a mapping: stat through map_files (CAP_SYS_ADMIN);
        without it the mapping's extent stands in for the size."""
        for key, hs in holdings.items():
            if any(h.allocated is not None for h in hs) or not any(
                h.deleted for h in hs
            ):
                continue
            for h in hs:
                if not h.map_range:
                    continue
                try:
                    path = self.table.paths.proc(h.pid, "map_files", h.map_range)
                    st = os.stat(path)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) == key:
                    h.allocated, h.apparent, h.mtime = _sizes(st)
                    break


def _sizes(st: os.stat_result) -> Tuple[int, int, float]:
    """(allocated, apparent, mtime): st_blocks x 512 is what tmpfs charges."""
    return st.st_blocks * 512, st.st_size, st.st_mtime
