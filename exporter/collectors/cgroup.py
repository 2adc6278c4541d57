"""The memory cgroup the shm is charged to: usage, limit, shmem, OOM kills (v1 and v2).
Which cgroup: --cgroup.path, else the first process matching --cgroup.target-process, else
the workload's, else on a host our own; the pod's where its limit binds. A sidecar shares
the server's PID namespace, not its cgroup (Docker on v1 mounts only the sidecar's own; v2
namespaces hide every other): the workload's cgroup is read where a cgroupfs mount shows it,
else estimated (shmwatch_cgroup_memory_estimated 1): Pss_Anon + Pss_File + the shm mounts'
used bytes (not Pss_Shmem: shm counted once). Missed: unmapped page cache, kernel memory;
overcounted: others' file pages."""

import os
import re
import resource
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from exporter.model.types import CgroupMemory
from exporter.host.cgroupfs import HIERARCHIES, LIMIT, USAGE, limits_above, read_files
from exporter.host.cgroupfs import cgroup_directories, effective_limit, parse_flat_keyed
from exporter.host.kube import POD_CGROUP_DIR, POD_CGROUP_ROOTS, pod_uid_of_mount
from exporter.host.mountinfo import parse_mountinfo
from exporter.host.paths import Paths, read_text
from exporter.host.proctable import Process, ProcessTable
from exporter.collectors.host_memory import meminfo
from exporter.collectors.source import Source, register

# Node mode walks again at most this often while a watched mount's pod is not listed.
MISSING_REWALK_SECONDS = 2.0
# A pod this near its limit is read every poll (PodOomRiskHigh: 0.9; the dashboard: 0.8).
STRETCH_BELOW_RATIO = 0.8
# An unchanged pod is read whole every this many polls at most (cAdvisor: up to 60 s).
POD_STRETCH_MAX = 32
# Usage and limit files kept open at most, and never past a quarter of the soft
# RLIMIT_NOFILE (a container's may be 1,024: connections need the rest).
MAX_KEPT_FDS = 1024
ESTIMATE_CGROUP = "estimate:workload"


class IncompleteView(LookupError):
    """Processes we cannot read may be the workload's: no estimate rather than a low one."""


def workload_processes(table: ProcessTable, own_pid: int) -> List[Process]:
    """The processes of our PID namespace that are not ours, lowest pid first."""
    try:
        own = table.cgroups("self")
    except OSError:
        return []  # without our own cgroup, ours cannot be told from the workload's
    walked, found = table.walk(), []
    if walked.unreadable or walked.invisible != 0:  # None: not known
        raise IncompleteView(
            f"{walked.unreadable or 0} process(es) in this PID namespace could not be read"
            + ("" if walked.invisible == 0 else " and some are hidden by hidepid")
            + ": the workload's memory cannot be estimated (give shmwatch the server's UID or "
            "CAP_SYS_PTRACE, or the host's cgroupfs)"
        )
    for proc in walked.processes:
        # "pause": a Kubernetes pod's sandbox, in its shared PID namespace.
        if proc.pid == own_pid or proc.comm == "pause" or _shmwatch(table, proc):
            continue
        try:
            if table.cgroups(proc.pid) == own:
                continue  # shmwatch's own processes (a shell exec'd into the sidecar)
        except FileNotFoundError:
            continue  # gone since the walk
        except OSError as err:
            raise IncompleteView(
                f"the cgroup of process {proc.pid} could not be read ({err.strerror or err}): "
                "the workload's memory cannot be estimated"
            ) from None
        found.append(proc)
    return sorted(found, key=lambda p: p.pid)


def _shmwatch(table: ProcessTable, proc: Process) -> bool:
    """`[python] shmwatch ...` or `python3 -m exporter ...`: not by comm, a Python server's too."""
    with suppress(OSError):
        words = table.cmdline(proc.pid).split()
        module = words[1:3] == ["-m", "exporter"]
        return module or any(os.path.basename(w) == "shmwatch" for w in words[:2])
    return False


def _links(directory: str) -> Optional[int]:
    """A directory's link count: 2 + its subdirectories (on cgroupfs too); None: not there."""
    with suppress(OSError):
        return os.stat(directory).st_nlink
    return None


@dataclass(eq=False)
class CgroupCollector(Source):
    paths: Paths
    cgroup_path: Optional[str] = None
    target_process: Optional[str] = None
    limit_override: Optional[int] = None
    node_mode: bool = False  # every pod's cgroup on the host, not one
    table: Optional[ProcessTable] = None
    mounts: Callable[[], Sequence[str]] = list  # the watched shm mounts
    kill_log_complete: Callable[[], bool] = lambda: False
    name = "cgroup"

    def __post_init__(self) -> None:
        self.table = self.table or ProcessTable(self.paths)
        self.target = re.compile(self.target_process) if self.target_process else None
        # Node mode: the last walk (pod cgroups, when, links of the directories walked into,
        # v1 containers); by pod: last read, stretch, due poll, probe; its usage and limit fds.
        self._listed: Optional[List[Tuple[str, int, str, str]]] = None
        self._walked_at = float("-inf")
        self._walked_links: Dict[str, Optional[int]] = {}
        self._children: Dict[str, List[str]] = {}
        self._kept: Dict[str, Tuple[CgroupMemory, int, int, Optional[tuple]]] = {}
        self._fds: Dict[str, List[int]] = {}
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._max_fds = MAX_KEPT_FDS if soft < 0 else min(MAX_KEPT_FDS, soft // 4)
        self._polls = 0

    def resolve(self, pid: object = "self") -> Tuple[str, int, str]:
        """-> (cgroup path, version, directory to read) of --cgroup.path, or of `pid`'s cgroup."""
        root, path = self.paths.sys("fs", "cgroup"), self.cgroup_path
        if path and path.startswith(root + "/"):  # a directory
            rel = path[len(root) :]
            if os.path.exists(os.path.join(path, "memory.current")):
                return rel, 2, path
            return rel.removeprefix("/memory") or "/", 1, path
        candidates = {"memory": path, "": path} if path else self.table.cgroups(pid)
        # In a private cgroup namespace another container's cgroup reads as /../<id>: only a
        # mount of the host's cgroupfs shows it, never a path joined onto ours.
        outside = any(p.startswith("/..") or "/../" in p for p in candidates.values())
        tried = []
        for base, version in () if outside else HIERARCHIES:
            path = candidates.get("memory" if version == 1 else "")
            if path is not None:
                tried.append(os.path.join(root, base, path.lstrip("/")))
                if os.path.exists(os.path.join(tried[-1], USAGE[version])):
                    return path, version, tried[-1]
        with suppress(OSError):  # then under any cgroupfs mount we can see
            entries = parse_mountinfo(read_text(self.paths.proc("self", "mountinfo")))
            for controller, version in HIERARCHIES[:2]:
                path = candidates.get(controller)
                shown = cgroup_directories(entries, path, version) if path else []
                for directory in shown:
                    if os.path.exists(os.path.join(directory, USAGE[version])):
                        return path, version, directory
        if outside:
            raise LookupError(
                f"cgroup {next(iter(candidates.values()))} is outside this container's cgroup "
                f"namespace; run shmwatch per node (DaemonSet) or mount the host's /sys/fs/cgroup"
            )
        where = ", ".join(tried) or "nothing"
        raise FileNotFoundError(f"no memory cgroup found (tried {where})")

    def collect(self) -> List[CgroupMemory]:
        """Every pod's cgroup in node mode, listed again only when the listing changed (walking
        200 pods' trees costs more than reading them); the one watched cgroup otherwise."""
        if self.node_mode:
            now = time.monotonic()
            watched = {pod_uid_of_mount(m) for m in self.mounts()} - {""}
            missing = not watched <= {uid for *_, uid in self._listed or ()}
            missing = missing and now - self._walked_at > MISSING_REWALK_SECONDS
            # A directory walked into gained or lost a pod cgroup (its link count), or went.
            made = any(_links(d) != n for d, n in self._walked_links.items())
            if self._listed is None or missing or made:
                self._listed = self.pod_cgroups()
            found = self.read_pods(self._listed)
            if len(found) < len(self._listed):  # a pod went away (or cannot be read)
                self._listed = None  # list again next time
            return found
        if self.cgroup_path:
            return [self.read(*self.resolve())]
        # In the host's PID namespace the processes are nobody's workload.
        host = self.table.kernel_threads_visible()
        processes = [] if host else workload_processes(self.table, os.getpid())
        if self.target:
            pid = self.table.find(self.target, exclude=os.getpid())
            if pid is None:
                raise LookupError(
                    f"no process matches --cgroup.target-process {self.target.pattern!r}"
                )
        elif processes:
            pid = processes[0].pid
        elif host:
            pid = "self"
        else:  # our cgroup is the exporter's: under OOM-risk names, the wrong pod's numbers
            raise LookupError(
                "no workload shares this PID namespace (docker --pid=container:<server>, Kubernetes "
                "shareProcessNamespace), and shmwatch's own cgroup is not the workload's: share it, "
                "or name the cgroup with --cgroup.path"
            )
        try:
            return [self.read(*self.binding(*self.resolve(pid)))]
        except (LookupError, FileNotFoundError):
            if not processes:
                raise
        # Each filesystem once (by device: one tmpfs may be watched twice).
        used = {}
        for mount in self.mounts():
            where = self.paths.host(mount)
            with suppress(OSError):
                st, device = os.statvfs(where), os.stat(where).st_dev
                used[device] = (st.f_blocks - st.f_bfree) * st.f_frsize
        shm = sum(used.values())
        ws, limit = self.table.resident(processes) + shm, self.limit_override
        source = "none" if limit is None else "flag"
        estimate = (ESTIMATE_CGROUP, 0, ws, limit, ws, shm, None, source)
        return [CgroupMemory(*estimate, estimated=True)]

    def pod_cgroups(self) -> List[Tuple[str, int, str, str]]:
        """Every pod's memory cgroup on the host -> [(path, version, directory, pod uid)]."""
        root = self.paths.sys("fs", "cgroup")
        found = []
        self._walked_at, self._walked_links, self._children = time.monotonic(), {}, {}
        for below_root, version in HIERARCHIES:
            base = os.path.join(root, below_root)
            for top in POD_CGROUP_ROOTS:
                start = os.path.join(base, top)
                self._walked_links[start] = None  # a start made later has links
                for directory, subdirs, files in os.walk(start):
                    match = POD_CGROUP_DIR.search(os.path.basename(directory))
                    if match and USAGE[version] in files:
                        path = "/" + os.path.relpath(directory, base)
                        uid = match.group(1).replace("_", "-")
                        found.append((path, version, directory, uid))
                        subdirs[:] = []  # containers below the pod are not pods
                    elif directory[len(start) :].count(os.sep) >= 2:
                        subdirs[:] = []
                    else:
                        self._walked_links[directory] = 2 + len(subdirs)
            if found:
                break  # one hierarchy holds the memory controller
        return sorted(found)

    def read_pods(self, listed: List[Tuple[str, int, str, str]]) -> List[CgroupMemory]:
        """Each listed pod's cgroup but those unreadable (gone: ENOENT, ENODEV; EACCES; a file
        cut short). As cAdvisor's housekeeping, one read unchanged is read whole after twice
        as many polls while the kernel log counts every kill (v1 counts one in the
        container's cgroup, which may go). Its usage and limit files are read every poll: a
        jump toward the limit, or a limit lowered, is read whole at the next poll."""
        above, swap = {}, None  # above: the QoS slices' limits, read once a pass
        stretch = self.kill_log_complete()
        kept, self._kept, self._polls = self._kept, {}, self._polls + 1
        for path, version, directory, uid in listed:
            last, every, due, probed = kept.get(directory, (None, 1, 0, None))
            # Probed before the read: a change between the two is read again, never hidden.
            probe = self._probe(directory, version, above) if stretch else None
            if self._polls < due and probe is not None and probe == probed:
                self._kept[directory] = (last, every, due, probed)
                continue
            if swap is None:
                swap = meminfo(self.paths).get("SwapTotal", 1) > 0
            try:
                memory = self.read(path, version, directory, uid, above, swap)
            except (OSError, ValueError):
                self.close(directory)
                continue
            memory = last if memory == last else memory  # the same object: memos hold
            usage, limit = memory.usage_bytes, memory.limit_bytes
            near = limit is not None and usage >= STRETCH_BELOW_RATIO * limit
            steady = stretch and memory is last and not near
            every = min(every * 2, POD_STRETCH_MAX) if steady else 1
            self._kept[directory] = (memory, every, self._polls + every, probe)
        for directory in kept.keys() - self._kept.keys():
            self.close(directory)  # a pod gone
        return [memory for memory, *_ in self._kept.values()]

    def _probe(self, directory: str, version: int, above: dict) -> Optional[tuple]:
        """The pod's usage and limit files, and the limits above it; None: unreadable. A pread
        of a kept descriptor reads a cgroup file afresh at a seventh of open, read, close."""
        files = [os.path.join(directory, n) for n in (USAGE[version], LIMIT[version])]
        try:
            if directory not in self._fds and 2 * len(self._fds) < self._max_fds:
                self._fds[directory] = fds = []
                for path in files:
                    fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            if fds := self._fds.get(directory):
                now = [os.pread(fd, 64, 0) for fd in fds]
            else:
                now = [read_text(path).encode() for path in files]
            return *now, *limits_above(directory, LIMIT[version], above)
        except (OSError, ValueError):  # the pod gone (ENODEV): read whole
            self.close(directory)
            return None

    def close(self, *directories: str) -> None:
        """The files kept open for these pods' directories, or for every pod."""
        for directory in directories or list(self._fds):
            for fd in self._fds.pop(directory, ()):
                os.close(fd)

    def read(self, path, version, directory, pod_uid="", above=None, swap=True):
        """--memory.limit-bytes binds where tighter (one workload's: never in node mode, `pod_uid`)."""
        fields = read_files(directory, version, above, swap)
        flag, limit = self.limit_override, fields["limit_bytes"]
        if flag is not None and not pod_uid and (limit is None or flag < limit):
            fields.update(limit_bytes=flag, limit_source="flag")
        if pod_uid and version == 1:
            fields["child_oom_kills"] = self._child_oom_kills(path, directory)
        return CgroupMemory(path, version, pod_uid=pod_uid, **fields)

    @staticmethod
    def binding(path: str, version: int, directory: str) -> Tuple[str, int, str]:
        """The pod's cgroup, where readable and the container has no tighter limit of its own
        (the pod's limit binds; shm stays charged to the pod when a container restarts)."""
        up, above = path.rstrip("/"), directory.rstrip("/")
        own = effective_limit(directory, version)[1] == "self"
        while not own and up.count("/") > 1:
            up, above = os.path.dirname(up), os.path.dirname(above)
            if POD_CGROUP_DIR.search(os.path.basename(up)):
                if os.access(os.path.join(above, "memory.stat"), os.R_OK):
                    return up, version, above
                break
        return path, version, directory

    def _child_oom_kills(self, path: str, directory: str) -> tuple:
        """A v1 pod's containers' OOM kill counts; listed again when links change or one went."""
        names = self._children.get(directory)
        for listing in (names is None or _links(directory) != len(names) + 2, True):
            try:
                if listing:
                    entries = os.scandir(directory)
                    names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
            except OSError:
                return ()  # gone already: the pod's own count stands
            self._children[directory] = names
            kills, up = {}, path.rstrip("/")
            for name in names:
                with suppress(OSError, KeyError):  # being removed (ENODEV), or gone
                    text = read_text(f"{directory}/{name}/memory.oom_control")
                    kills[f"{up}/{name}"] = parse_flat_keyed(text)["oom_kill"]
            if listing or len(kills) == len(names):
                return tuple(sorted(kills.items()))


register(
    "cgroup",
    lambda c: CgroupCollector(
        c.paths,
        c.cfg.cgroup_path,
        c.cfg.cgroup_target_process,
        c.memory_limit,
        node_mode=c.node,
        table=c.table,
        kill_log_complete=c.kill_log_complete,
        mounts=c.mounts,
    ),
)
