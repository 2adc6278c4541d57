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
from typing import (
    Dict,
    List,
    Optional,
    Pattern,
    Sequence,
    Tuple,
    Union,
)

from exporter.model.types import CgroupMemory
from exporter.host.cgroupfs import HIERARCHIES, LIMIT, USAGE, BindingLimit, LevelLimit
from exporter.host.cgroupfs import LimitsAbove, cgroup_directories, effective_limit
from exporter.host.cgroupfs import limits_above, parse_flat_keyed, read_files
from exporter.host.kube import POD_CGROUP_DIR, POD_CGROUP_ROOTS, pod_uid_of_mount
from exporter.host.mountinfo import parse_mountinfo
from exporter.host.paths import OUT_OF_RESOURCES, Paths, read_text
from exporter.host.proctable import Process, ProcessTable
from exporter.collectors.host_memory import meminfo
from exporter.collectors.source import Context, RunInput, Source, register

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


@dataclass(frozen=True)
class CgroupAt:
    """A memory cgroup: its path as /proc/<pid>/cgroup names it, and where it is read."""

    path: str
    version: int  # 1 or 2
    directory: str


@dataclass(frozen=True, order=True)
class PodCgroup:
    """A pod's memory cgroup found by node mode's walk (ordered as the walk lists them)."""

    path: str
    version: int
    directory: str
    pod_uid: str


@dataclass(frozen=True)
class Probe:
    """A pod's usage and limit files as read, and the limits above it: a change in any of
    them has the pod read whole at once."""

    usage: bytes
    limit: bytes
    above: Tuple[LevelLimit, ...]


@dataclass(frozen=True)
class PodReading:
    """Node mode's last whole read of a pod, and when it is read whole again."""

    memory: CgroupMemory
    every: int  # polls between whole reads: doubles while steady
    due: int  # the poll it is read whole at
    probe: Optional[Probe]  # its files when read; None: not probed


@dataclass(eq=False)
class CgroupCollector(Source):
    paths: Paths
    cgroup_path: Optional[str] = None
    target_process: Optional[str] = None
    limit_override: Optional[int] = None
    node_mode: bool = False  # every pod's cgroup on the host, not one
    table: Optional[ProcessTable] = None
    name = "cgroup"

    def __post_init__(self) -> None:
        self.process_table = self.table or ProcessTable(self.paths)
        self.target: Optional[Pattern[str]] = None
        if self.target_process:
            self.target = re.compile(self.target_process)
        # Node mode: the last walk (pod cgroups, when, links of the directories walked into,
        # v1 containers); by pod: its last whole read; its usage and limit fds.
        self._listed: Optional[List[PodCgroup]] = None
        self._walked_at = float("-inf")
        self._walked_links: Dict[str, Optional[int]] = {}
        self._children: Dict[str, List[str]] = {}
        self._kept: Dict[str, PodReading] = {}
        self._fds: Dict[str, List[int]] = {}
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._max_fds = MAX_KEPT_FDS if soft < 0 else min(MAX_KEPT_FDS, soft // 4)
        self._polls = 0

    # --- which cgroup -------------------------------------------------------------------

    def resolve(self, pid: Union[int, str] = "self") -> CgroupAt:
        """The cgroup --cgroup.path names, or `pid`'s: under /sys/fs/cgroup, else under any
        cgroupfs mount that shows it."""
        root = self.paths.sys("fs", "cgroup")
        if self.cgroup_path and self.cgroup_path.startswith(root + "/"):
            return _named_directory(root, self.cgroup_path)
        candidates = self._candidates(pid)
        # In a private cgroup namespace another container's cgroup reads as /../<id>: only a
        # mount of the host's cgroupfs shows it, never a path joined onto ours.
        outside = any(p.startswith("/..") or "/../" in p for p in candidates.values())
        tried = [] if outside else _under_root(root, candidates)
        for at in tried:
            if os.path.exists(os.path.join(at.directory, USAGE[at.version])):
                return at
        found = self._under_a_mount(candidates)
        if found is not None:
            return found
        if outside:
            raise LookupError(
                f"cgroup {next(iter(candidates.values()))} is outside this container's cgroup "
                f"namespace; run shmwatch per node (DaemonSet) or mount the host's /sys/fs/cgroup"
            )
        where = ", ".join(at.directory for at in tried) or "nothing"
        raise FileNotFoundError(f"no memory cgroup found (tried {where})")

    def _candidates(self, pid: Union[int, str]) -> Dict[str, str]:
        """Controller ('memory', '' for v2) -> the cgroup path to look for."""
        if self.cgroup_path:
            return {"memory": self.cgroup_path, "": self.cgroup_path}
        return self.process_table.cgroups(pid)

    def _under_a_mount(self, candidates: Dict[str, str]) -> Optional[CgroupAt]:
        """The cgroup under any cgroupfs mount we can see (the host's, given read-only)."""
        try:
            mountinfo = read_text(self.paths.proc("self", "mountinfo"))
        except OSError:
            return None
        entries = parse_mountinfo(mountinfo)
        for hierarchy in HIERARCHIES[:2]:  # v1's, v2's ("unified" is v2's again)
            path, version = candidates.get(hierarchy.controller), hierarchy.version
            shown = cgroup_directories(entries, path, version) if path else []
            for directory in shown:
                if os.path.exists(os.path.join(directory, USAGE[version])):
                    return CgroupAt(
                        path=path or "", version=version, directory=directory
                    )
        return None

    @staticmethod
    def binding(at: CgroupAt) -> CgroupAt:
        """The pod's cgroup, where readable and the container has no tighter limit of its own
        (the pod's limit binds; shm stays charged to the pod when a container restarts)."""
        up, above = at.path.rstrip("/"), at.directory.rstrip("/")
        own = effective_limit(at.directory, at.version).limit_source == "self"
        while not own and up.count("/") > 1:
            up, above = os.path.dirname(up), os.path.dirname(above)
            if POD_CGROUP_DIR.search(os.path.basename(up)):
                if os.access(os.path.join(above, "memory.stat"), os.R_OK):
                    return CgroupAt(path=up, version=at.version, directory=above)
                break
        return at

    # --- one run ------------------------------------------------------------------------

    def collect(self, run: RunInput = RunInput()) -> List[CgroupMemory]:
        """Every pod's cgroup in node mode; the one watched cgroup otherwise. `run.mounts`:
        the watched shm mounts."""
        if self.node_mode:
            return self._collect_pods(run)
        if self.cgroup_path:
            at = self.resolve()
            return [self.read(at.path, at.version, at.directory)]
        return [self._collect_workload(run.mounts)]

    def _collect_pods(self, run: RunInput) -> List[CgroupMemory]:
        """Listed again only when the listing changed (walking 200 pods' trees costs more
        than reading them)."""
        now = time.monotonic()
        watched = {pod_uid_of_mount(m) for m in run.mounts} - {""}
        missing = not watched <= {pod.pod_uid for pod in self._listed or ()}
        missing = missing and now - self._walked_at > MISSING_REWALK_SECONDS
        # A directory walked into gained or lost a pod cgroup (its link count), or went.
        made = any(_links(d) != n for d, n in self._walked_links.items())
        if self._listed is None or missing or made:
            self._listed = self.pod_cgroups()
        found = self.read_pods(self._listed, stretch=run.kill_log_complete)
        if len(found) < len(self._listed):  # a pod went away (or cannot be read)
            self._listed = None  # list again next time
        return found

    def _collect_workload(self, mounts: Sequence[str]) -> CgroupMemory:
        """The workload's cgroup (the pod's where its limit binds), else its estimate."""
        # In the host's PID namespace the processes are nobody's workload.
        host = self.process_table.kernel_threads_visible()
        processes = [] if host else workload_processes(self.process_table, os.getpid())
        pid = self._workload_pid(processes, host)
        try:
            at = self.binding(self.resolve(pid))
            return self.read(at.path, at.version, at.directory)
        except (LookupError, FileNotFoundError):
            if not processes:
                raise
        return self._estimate(processes, mounts)

    def _workload_pid(self, processes: List[Process], host: bool) -> Union[int, str]:
        """--cgroup.target-process's, else the workload's first, else ours on a host."""
        if self.target:
            pid = self.process_table.find(self.target, exclude=os.getpid())
            if pid is None:
                raise LookupError(
                    f"no process matches --cgroup.target-process {self.target.pattern!r}"
                )
            return pid
        if processes:
            return processes[0].pid
        if host:
            return "self"
        # our cgroup is the exporter's: under OOM-risk names, the wrong pod's numbers
        raise LookupError(
            "no workload shares this PID namespace (docker --pid=container:<server>, Kubernetes "
            "shareProcessNamespace), and shmwatch's own cgroup is not the workload's: share it, "
            "or name the cgroup with --cgroup.path"
        )

    def _estimate(
        self, processes: List[Process], mounts: Sequence[str]
    ) -> CgroupMemory:
        """The workload's resident memory and the watched mounts' used bytes, as a cgroup."""
        shm = self._shm_used(mounts)
        working_set, limit = (
            self.process_table.resident(processes) + shm,
            self.limit_override,
        )
        return CgroupMemory(
            cgroup=ESTIMATE_CGROUP,
            version=0,
            usage_bytes=working_set,
            limit_bytes=limit,
            working_set_bytes=working_set,
            shmem_bytes=shm,
            oom_kills=None,
            limit_source="none" if limit is None else "flag",
            estimated=True,
        )

    def _shm_used(self, mounts: Sequence[str]) -> int:
        """The watched mounts' used bytes, each filesystem once (by device: one tmpfs may be
        watched twice)."""
        used = {}
        for mount in mounts:
            where = self.paths.host(mount)
            with suppress(OSError):
                st, device = os.statvfs(where), os.stat(where).st_dev
                used[device] = (st.f_blocks - st.f_bfree) * st.f_frsize
        return sum(used.values())

    # --- node mode's pods ---------------------------------------------------------------

    def pod_cgroups(self) -> List[PodCgroup]:
        """Every pod's memory cgroup on the host."""
        root = self.paths.sys("fs", "cgroup")
        found: List[PodCgroup] = []
        self._walked_at, self._walked_links, self._children = time.monotonic(), {}, {}
        for hierarchy in HIERARCHIES:
            base = os.path.join(root, hierarchy.directory)
            for top in POD_CGROUP_ROOTS:
                found += self._walk_pods(
                    base, os.path.join(base, top), hierarchy.version
                )
            if found:
                break  # one hierarchy holds the memory controller
        return sorted(found)

    def _walk_pods(self, base: str, start: str, version: int) -> List[PodCgroup]:
        """The pod cgroups below `start` (kubepods), noting the link count of each directory
        walked into (a pod made or gone there changes it)."""
        found = []
        self._walked_links[start] = None  # a start made later has links
        for directory, subdirs, files in os.walk(start):
            match = POD_CGROUP_DIR.search(os.path.basename(directory))
            if match and USAGE[version] in files:
                pod = PodCgroup(
                    path="/" + os.path.relpath(directory, base),
                    version=version,
                    directory=directory,
                    pod_uid=match.group(1).replace("_", "-"),
                )
                found.append(pod)
                subdirs[:] = []  # containers below the pod are not pods
            elif directory[len(start) :].count(os.sep) >= 2:
                subdirs[:] = []
            else:
                self._walked_links[directory] = 2 + len(subdirs)
        return found

    def read_pods(
        self, listed: List[PodCgroup], stretch: bool = False
    ) -> List[CgroupMemory]:
        """Each listed pod's cgroup but those unreadable (gone: ENOENT, ENODEV; EACCES; a file
        cut short). As cAdvisor's housekeeping, one read unchanged is read whole after twice
        as many polls while the kernel log counts every kill (v1 counts one in the
        container's cgroup, which may go: `stretch`). Its usage and limit files are read every
        poll: a jump toward the limit, or a limit lowered, is read whole at the next poll."""
        kept, self._kept, self._polls = self._kept, {}, self._polls + 1
        try:
            self._read_listed(listed, kept, stretch)
        except BaseException:
            # A pass cut short (out of fds or memory): the pods it did not get to are kept
            # as they were, their files still open (closed when they are gone, as ever).
            for directory, reading in kept.items():
                self._kept.setdefault(directory, reading)
            raise
        for directory in kept.keys() - self._kept.keys():
            self.close(directory)  # a pod gone
        return [reading.memory for reading in self._kept.values()]

    def _read_listed(
        self, listed: List[PodCgroup], kept: Dict[str, PodReading], stretch: bool
    ) -> None:
        """`read_pods`' pass: each listed pod read (or its last reading kept) into
        `_kept`; `kept`: the last pass's readings."""
        above: LimitsAbove = {}  # the QoS slices' limits, read once a pass
        swap: Optional[bool] = None
        for pod in listed:
            last = kept.get(pod.directory)
            # Probed before the read: a change between the two is read again, never hidden.
            probe = self._probe(pod.directory, pod.version, above) if stretch else None
            if (
                last
                and self._polls < last.due
                and probe is not None
                and probe == last.probe
            ):
                self._kept[pod.directory] = last
                continue
            if swap is None:
                swap = meminfo(self.paths).get("SwapTotal", 1) > 0
            reading = self._read_pod(pod, last, probe, above, swap, stretch)
            if reading is not None:
                self._kept[pod.directory] = reading

    def _read_pod(
        self,
        pod: PodCgroup,
        last: Optional[PodReading],
        probe: Optional[Probe],
        above: LimitsAbove,
        swap: bool,
        stretch: bool,
    ) -> Optional[PodReading]:
        """A pod read whole, and when next; None: it could not be read. Out of fds or
        memory (which says nothing of the pod) fails the run: the pod is not taken for gone."""
        try:
            memory = self.read(
                pod.path, pod.version, pod.directory, pod.pod_uid, above, swap
            )
        except OSError as err:
            self.close(pod.directory)
            if err.errno in OUT_OF_RESOURCES:
                raise
            return None
        except ValueError:
            self.close(pod.directory)
            return None
        previous = last.memory if last else None
        if memory == previous:
            memory = previous  # the same object: memos hold
        limit = memory.limit_bytes
        near = limit is not None and memory.usage_bytes >= STRETCH_BELOW_RATIO * limit
        steady = stretch and memory is previous and not near
        every = min(last.every * 2, POD_STRETCH_MAX) if last and steady else 1
        return PodReading(
            memory=memory, every=every, due=self._polls + every, probe=probe
        )

    def _probe(
        self, directory: str, version: int, above: LimitsAbove
    ) -> Optional[Probe]:
        """The pod's usage and limit files, and the limits above it; None: unreadable. A pread
        of a kept descriptor reads a cgroup file afresh at a seventh of open, read, close."""
        files = [os.path.join(directory, n) for n in (USAGE[version], LIMIT[version])]
        try:
            if directory not in self._fds and 2 * len(self._fds) < self._max_fds:
                self._fds[directory] = fds = []
                for path in files:
                    fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            if fds := self._fds.get(directory, []):
                usage, limit = (os.pread(fd, 64, 0) for fd in fds)
            else:
                usage, limit = (read_text(path).encode() for path in files)
            chain = limits_above(directory, LIMIT[version], above)
            return Probe(usage=usage, limit=limit, above=chain)
        except (OSError, ValueError):  # the pod gone (ENODEV): read whole
            self.close(directory)
            return None

    def close(self, *directories: str) -> None:
        """The files kept open for these pods' directories, or for every pod."""
        for directory in directories or list(self._fds):
            for fd in self._fds.pop(directory, ()):
                os.close(fd)

    # --- reading one cgroup -------------------------------------------------------------

    def read(
        self,
        path: str,
        version: int,
        directory: str,
        pod_uid: str = "",
        above: Optional[LimitsAbove] = None,
        swap: bool = True,
    ) -> CgroupMemory:
        """--memory.limit-bytes binds where tighter (one workload's: never in node mode, `pod_uid`)."""
        files = read_files(directory, version, above, swap)
        limit, flag = files.limit, self.limit_override
        if flag is not None and not pod_uid:
            if limit.limit_bytes is None or flag < limit.limit_bytes:
                limit = BindingLimit(limit_bytes=flag, limit_source="flag")
        children: Tuple[Tuple[str, int], ...] = ()
        if pod_uid and version == 1:
            children = self._child_oom_kills(path, directory)
        return CgroupMemory(
            cgroup=path,
            version=version,
            usage_bytes=files.usage_bytes,
            limit_bytes=limit.limit_bytes,
            working_set_bytes=files.working_set_bytes,
            shmem_bytes=files.shmem_bytes,
            oom_kills=files.oom_kills,
            limit_source=limit.limit_source,
            pod_uid=pod_uid,
            child_oom_kills=children,
            high_bytes=files.high_bytes,
            events=files.events,
            swap_bytes=files.swap_bytes,
            swap_limit_bytes=files.swap_limit_bytes,
        )

    def _child_oom_kills(
        self, path: str, directory: str
    ) -> Tuple[Tuple[str, int], ...]:
        """A v1 pod's containers' OOM kill counts; listed again when links change or one went."""
        names = self._children.get(directory)
        if names is None or _links(directory) != len(names) + 2:
            names = self._list_children(directory)
            if names is None:
                return ()  # gone already: the pod's own count stands
            return self._count_kills(path, directory, names)
        kills = self._count_kills(path, directory, names)
        if len(kills) == len(names):
            return kills
        names = self._list_children(directory)  # one went since listed
        return () if names is None else self._count_kills(path, directory, names)

    def _list_children(self, directory: str) -> Optional[List[str]]:
        """The container cgroups below a pod's, remembered; None: the pod is gone."""
        try:
            entries = os.scandir(directory)
            names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            return None
        self._children[directory] = names
        return names

    @staticmethod
    def _count_kills(
        path: str, directory: str, names: List[str]
    ) -> Tuple[Tuple[str, int], ...]:
        kills: Dict[str, int] = {}
        up = path.rstrip("/")
        for name in names:
            with suppress(OSError, KeyError):  # being removed (ENODEV), or gone
                text = read_text(f"{directory}/{name}/memory.oom_control")
                kills[f"{up}/{name}"] = parse_flat_keyed(text)["oom_kill"]
        return tuple(sorted(kills.items()))


def _named_directory(root: str, directory: str) -> CgroupAt:
    """--cgroup.path given as a directory under /sys/fs/cgroup: v2 if it has memory.current."""
    rel = directory[len(root) :]
    if os.path.exists(os.path.join(directory, "memory.current")):
        return CgroupAt(path=rel, version=2, directory=directory)
    return CgroupAt(
        path=rel.removeprefix("/memory") or "/", version=1, directory=directory
    )


def _under_root(root: str, candidates: Dict[str, str]) -> List[CgroupAt]:
    """Where each hierarchy (v1's memory, v2's) would show the cgroup under /sys/fs/cgroup."""
    out = []
    for hierarchy in HIERARCHIES:
        path = candidates.get(hierarchy.controller)
        if path is not None:
            directory = os.path.join(root, hierarchy.directory, path.lstrip("/"))
            at = CgroupAt(path=path, version=hierarchy.version, directory=directory)
            out.append(at)
    return out


def _cgroup_collector(c: Context) -> CgroupCollector:
    return CgroupCollector(
        c.paths,
        cgroup_path=c.cfg.cgroup_path,
        target_process=c.cfg.cgroup_target_process,
        limit_override=c.memory_limit,
        node_mode=c.node,
        table=c.table,
    )


register("cgroup", _cgroup_collector)
