"""Every reader of /proc/<pid> goes through here. A process is known by (pid, start time),
so a reused pid is never taken for the old one."""

import errno
import logging
import os
import threading
from contextlib import suppress
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Pattern, Sequence, Set, Tuple

from exporter.host.kube import pod_uid_in_cgroup
from exporter.host.mountinfo import parse_mountinfo
from exporter.host.paths import Paths, read_text

log = logging.getLogger(__name__)

PF_KTHREAD = 0x00200000  # include/linux/sched.h: kernel threads map no files
RESERVED_PIDS = 300  # kernel/pid.c: after a wrap, pids start again above these
INITIAL_PID_NAMESPACE = f"pid:[{0xEFFFFFFC}]"  # PROC_PID_INIT_INO (linux/proc_ns.h)
MAX_PROBE_PIDS = 1 << 16  # a pidfd_open each: ok in a pod's PID namespace, not a host's
# Kernels before 5.8 print hidepid=0/1/2(/4); later ones the names (fs/proc/root.c).
HIDEPID_NAMES = {"0": "off", "1": "noaccess", "2": "invisible", "4": "ptraceable"}
HIDEPID_UNKNOWN = "unknown"  # our procfs's mount not found, or mountinfo not readable


@dataclass(frozen=True)
class PidCounts:
    """How far pids have gone: whether a pid known earlier may be another process now."""

    last_pid: int  # ns_last_pid: the last pid handed out
    forks: int  # processes created since boot (/proc/stat's "processes")
    pid_max: int


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat the process table reads."""

    comm: str
    flags: int  # PF_* (PF_KTHREAD: a kernel thread)
    start_time: int  # clock ticks after boot
    ppid: int


def parse_stat(text: str) -> ProcStat:
    """/proc/<pid>/stat -> its comm, flags, start time and ppid. comm may hold spaces and ')'."""
    close = text.rindex(")")
    rest = text[close + 2 :].split()  # from field 3: ppid 4, flags 9, starttime 22
    return ProcStat(
        comm=text[text.index("(") + 1 : close],
        flags=int(rest[6]),
        start_time=int(rest[19]),
        ppid=int(rest[1]),
    )


def parse_proc_cgroup(text: str) -> Dict[str, str]:
    """/proc/<pid>/cgroup -> {controller: path}; the v2 line '0::/path' has controller ''."""
    result: Dict[str, str] = {}
    for parts in (line.split(":", 2) for line in text.splitlines()):
        if len(parts) == 3:
            result.update(dict.fromkeys(parts[1].split(","), parts[2]))
    return result


def parse_meminfo(text: str) -> Dict[str, int]:
    """'MemTotal:  24683568 kB' lines (meminfo, smaps_rollup) -> {'MemTotal': bytes}.
    Malformed lines (smaps_rollup's first, of the mapping) are skipped."""
    values: Dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields, key = rest.split() + ["", ""], key.strip()
        scale = 1024 if fields[1].lower() == "kb" else 1
        with suppress(ValueError):
            if " " not in key:
                values[key] = int(fields[0]) * scale
    return values


@dataclass(frozen=True)
class Process:
    pid: int
    comm: str
    start_time: int  # clock ticks after boot: with pid, identifies the process
    uid: int  # owner of /proc/<pid>: the process's effective UID
    ppid: int = 0


@dataclass(frozen=True)
class ProcessWalk:
    processes: List[Process]
    unreadable: int  # listed, but stat could not be read (permission, hidepid=1)
    invisible: Optional[int] = 0  # exist but not listed (hidepid); None: uncounted
    # False when /proc shows, outside the initial PID namespace, no process of another
    # container (a sidecar without shareProcessNamespace): "no holder found" proves nothing.
    workload_visible: bool = True


@dataclass(frozen=True)
class Identified:
    """The user processes among pids asked about, and how many could not be read."""

    processes: List[Process]
    unreadable: int


def parse_hidepid(options: str) -> str:
    key = "hidepid="
    values = [o[len(key) :] for o in options.split(",") if o.startswith(key)]
    return HIDEPID_NAMES.get(values[0], values[0]) if values else "off"


class ProcessTable:
    said_no_pid_counts = False

    def __init__(self, paths: Paths):
        self.paths = paths
        self._lock = threading.Lock()
        self._pods: Dict[Tuple[int, int], str] = {}  # (pid, start time) -> pod UID

    def last_pid(self) -> int:
        """The last pid handed out in our PID namespace (needs CONFIG_CHECKPOINT_RESTORE)."""
        return int(read_text(self.paths.proc("sys", "kernel", "ns_last_pid")))

    def pid_max(self) -> int:
        return int(read_text(self.paths.proc("sys", "kernel", "pid_max")))

    def pids(self) -> List[int]:
        return list(map(int, filter(str.isdigit, os.listdir(self.paths.procfs))))

    def identify_all(self, pids: Iterable[int], kernel_threads: Set[int]) -> Identified:
        """The user processes among `pids` still there, and how many could not be read;
        kernel threads join `kernel_threads`, which are not read again."""
        found, unreadable = [], 0
        for pid in sorted(set(pids) - kernel_threads):
            try:
                raw = read_text(self.paths.proc(pid, "stat"))
                uid = os.stat(self.paths.proc(pid)).st_uid
                stat = parse_stat(raw)
            except (FileNotFoundError, ProcessLookupError):
                continue  # gone
            except (OSError, ValueError, IndexError):
                unreadable += 1
                continue
            if stat.flags & PF_KTHREAD:
                kernel_threads.add(pid)
            else:
                process = Process(
                    pid=pid,
                    comm=stat.comm,
                    start_time=stat.start_time,
                    uid=uid,
                    ppid=stat.ppid,
                )
                found.append(process)
        return Identified(processes=found, unreadable=unreadable)

    def walk(self) -> ProcessWalk:
        """Every user process; those we may not read, or /proc hides (hidepid), are counted."""
        try:
            listed = self.pids()
        except OSError:  # no process could be seen: none is proven absent
            return ProcessWalk(processes=[], unreadable=0, invisible=None)
        identified = self.identify_all(listed, set())
        found, unreadable = identified.processes, identified.unreadable
        alive = {(p.pid, p.start_time) for p in found}
        with self._lock:
            self._pods = {k: pod for k, pod in self._pods.items() if k in alive}
        invisible = self._invisible(set(listed))
        visible = bool(unreadable or invisible) or self._workload_visible(found)
        return ProcessWalk(
            processes=found,
            unreadable=unreadable,
            invisible=invisible,
            workload_visible=visible,
        )

    def _workload_visible(self, found: List[Process]) -> bool:
        """Whether /proc is the initial PID namespace's (it lists every process there is), or
        shows another container's process (another mount namespace than shmwatch's)."""
        if self._ns("self", "pid") == INITIAL_PID_NAMESPACE:
            return True
        if not (mine := self._ns("self", "mnt")):
            return bool(found)  # a fixture tree, or another namespace's procfs
        return any(self._ns(p.pid, "mnt") not in (mine, "") for p in found)

    def _ns(self, pid: object, kind: str) -> str:  # '?': another UID's, maybe another's
        try:
            return os.readlink(self.paths.proc(pid, "ns", kind))
        except OSError as err:  # '': gone, or a zombie (it holds nothing)
            return "?" if err.errno == errno.EACCES else ""

    def _invisible(self, listed: Set[int]) -> Optional[int]:
        """How many processes exist that /proc does not list; None: uncounted."""
        mode = self.hidepid()
        if mode in ("off", "noaccess"):
            return 0  # noaccess lists every pid, only their files are denied
        if mode == HIDEPID_UNKNOWN and not self.pid_namespace_is_ours():
            return None  # our probes would count another PID namespace's pids
        return self.count_invisible(listed)

    def pid_namespace_is_ours(self) -> bool:
        """Whether our procfs shows our PID namespace: its self is our pid there (a fixture
        tree has none; another namespace's procfs shows us by another pid, or not at all)."""
        where = os.path.realpath(self.paths.proc("self"))
        return os.path.basename(where) == str(os.getpid())

    def hidepid(self) -> str:
        """How our procfs hides processes, from its mount options; HIDEPID_UNKNOWN when
        mountinfo cannot be read or shows no procfs mounted at our path (never taken for
        'off': a hidden live process would then look exited)."""
        where = os.path.realpath(self.paths.procfs)
        with suppress(OSError):
            entries = parse_mountinfo(read_text(self.paths.proc("self", "mountinfo")))
            for entry in reversed(entries):
                if entry.fstype == "proc" and entry.mount_point == where:
                    return parse_hidepid(entry.options)
        return HIDEPID_UNKNOWN

    def count_invisible(self, listed: Set[int]) -> Optional[int]:
        """Processes of our PID namespace that /proc does not list: pidfd_open() needs no
        permission and refuses threads (EINVAL)."""
        if (probe := getattr(os, "pidfd_open", None)) is None:
            return None  # a Python built on headers older than Linux 5.3
        try:
            last, pid_max = self.last_pid(), self.pid_max()
        except (OSError, ValueError):
            return None
        if pid_max <= MAX_PROBE_PIDS:
            top = pid_max  # every pid there can be
        elif last <= MAX_PROBE_PIDS and max(listed, default=0) <= last:
            # No listed pid above the last one handed out: nothing wrapped, none lives above.
            top = last
        else:
            return None  # wrapped, or too many to probe: hidden processes may exist, uncounted
        hidden = 0
        for pid in (p for p in range(1, top + 1) if p not in listed):
            try:
                os.close(probe(pid))
            except OSError as err:
                if err.errno in (errno.ESRCH, errno.EINVAL, errno.ENOENT):
                    continue  # no such process; a thread (EINVAL, or ENOENT on newer kernels)
                return None  # ENOSYS before Linux 5.3, EPERM from a seccomp profile: unknown
            hidden += 1
        return hidden

    def comm(self, pid: int) -> str:
        with suppress(OSError):
            return read_text(self.paths.proc(pid, "comm")).strip() or "unknown"
        return "unknown"

    def cmdline(self, pid: int) -> str:
        with open(self.paths.proc(pid, "cmdline"), "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()

    def find(self, pattern: Pattern[str], exclude: int = -1) -> Optional[int]:
        with suppress(OSError):
            for pid in sorted(set(self.pids()) - {exclude}):
                with suppress(OSError):
                    comm = read_text(self.paths.proc(pid, "comm")).strip()
                    # comm as read, not comm()'s "unknown"
                    if any(map(pattern.search, (comm, self.cmdline(pid)))):
                        return pid
        return None

    def cgroups(self, pid: object) -> Dict[str, str]:
        return parse_proc_cgroup(read_text(self.paths.proc(pid, "cgroup")))

    def pod_uid(self, proc: Process) -> str:
        """The pod a process runs in ('' outside Kubernetes); a process never changes pod."""
        key = (proc.pid, proc.start_time)  # no lock: walk() replaces the dict whole
        if (cached := self._pods.get(key)) is not None:
            return cached
        try:
            pod = pod_uid_in_cgroup(read_text(self.paths.proc(proc.pid, "cgroup")))
        except OSError:
            return ""
        with self._lock:
            self._pods[key] = pod
        return pod

    def kernel_threads_visible(self) -> bool:
        """True in the host's PID namespace: kthreadd (pid 2) is listed in no other."""
        kernel: Set[int] = set()
        self.identify_all([2], kernel)
        return 2 in kernel

    def resident(self, processes: Sequence[Process]) -> int:
        """Proportional anonymous + file-backed resident bytes of `processes` (shm left out)."""
        total, unreadable = 0, []
        for proc in processes:
            try:
                text = read_text(self.paths.proc(proc.pid, "smaps_rollup"))
            except FileNotFoundError:
                continue  # exited: it holds nothing now
            except OSError:
                unreadable.append(f"{proc.comm}[{proc.pid}]")
                continue
            rollup = parse_meminfo(text)
            if "Pss_Anon" in rollup:
                total += rollup["Pss_Anon"] + rollup.get("Pss_File", 0)
            else:  # before Linux 5.? smaps_rollup has no Pss_Anon: Pss less what is shm
                total += max(0, rollup.get("Pss", 0) - rollup.get("Pss_Shmem", 0))
        if unreadable:
            # Part of the picture would be a confident understatement: no estimate at all.
            raise PermissionError(
                f"cannot estimate the workload's memory: smaps_rollup of {', '.join(unreadable[:5])} "
                f"not readable (run shmwatch as the server's UID or with CAP_SYS_PTRACE, or give it "
                f"the host's cgroupfs read-only)"
            )
        return total

    def maps(self, pid: int) -> str:
        return read_text(self.paths.proc(pid, "maps"))

    def pid_counts(self) -> Optional[PidCounts]:
        try:
            last_pid, pid_max = self.last_pid(), self.pid_max()
            stat = read_text(self.paths.proc("stat"))
            at = stat.index("\nprocesses ") + len("\nprocesses ")
            forks = int(stat[at : stat.index("\n", at)])
            return PidCounts(last_pid=last_pid, forks=forks, pid_max=pid_max)
        except (OSError, ValueError):
            if not ProcessTable.said_no_pid_counts:
                ProcessTable.said_no_pid_counts = True  # once per process
                log.info(
                    "cannot read ns_last_pid or the fork count: node mode reads every process "
                    "at each inventory run (a pid it knows may be another process)"
                )
            return None


def pids_wrapped(last: Optional[PidCounts], now: Optional[PidCounts]) -> bool:
    """Whether a pid known at `last` may be another process `now` (or we cannot tell): pids
    rise, so only if ns_last_pid went down or more forks came than there are pids."""
    if now is None:
        return True
    if last is None:
        return False  # the first reading
    went_down = now.last_pid < last.last_pid
    return went_down or now.forks - last.forks >= now.pid_max - RESERVED_PIDS
