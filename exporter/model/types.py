"""The observations: what each source returns, typed; the model step joins them."""

import re
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from exporter.host.kube import POD_UID_IN_CGROUP, pod_uid_in_cgroup
from exporter.model.classes import CLASS_NAMES


@dataclass(frozen=True)
class Target:
    mount: str  # the mount point as the host sees it (read through --path.rootfs)
    labels: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MountSet:
    targets: List[Target]

    def mounts(self) -> List[str]:
        return [t.mount for t in self.targets]


@dataclass(frozen=True)
class MountUsage:
    mount: str  # as configured (the path the workload sees)
    fstype: str
    source: str
    is_mount_point: bool
    error: Optional[str] = None
    size_bytes: int = 0
    used_bytes: int = 0
    available_bytes: int = 0
    inodes: int = 0
    inodes_free: int = 0
    instance: Tuple = ()  # which mount instance (device, mount ID...); () if not known
    noswap: bool = False  # mounted with noswap: its pages cannot go to swap

    @property
    def usage_ratio(self) -> float:
        return self.used_bytes / self.size_bytes if self.size_bytes else 0.0


@dataclass(frozen=True)
class CgroupMemory:
    cgroup: str  # the path as in /proc/<pid>/cgroup, e.g. /kubepods/burstable/pod…
    version: int  # 1 or 2
    usage_bytes: int
    limit_bytes: Optional[int]  # None: unlimited
    working_set_bytes: int
    shmem_bytes: Optional[int]
    oom_kills: Optional[int]  # None where not counted (v1 before 4.13)
    # Where the limit binds: "pod" (a pod's cgroup, it or above it), "self", "ancestor",
    # "flag" (--memory.limit-bytes) or "none".
    limit_source: str
    pod_uid: str = ""  # node mode: the pod this cgroup belongs to
    estimated: bool = False  # True: no cgroup was read; the workload's processes and shm (collectors/cgroup.py)
    # Node mode, v1: (path, OOM kills) of each container cgroup; why: ModelStep._oom_counts
    child_oom_kills: Tuple[Tuple[str, int], ...] = ()
    high_bytes: Optional[int] = None  # v2 memory.high: throttled and reclaimed above it
    # memory.events (v1: oom_kill, failcnt as max)
    events: Tuple[Tuple[str, int], ...] = ()
    swap_bytes: Optional[int] = None  # None: no swap accounting
    swap_limit_bytes: Optional[int] = None  # None: unlimited or not told (v1)

    @property
    def oom_risk_ratio(self) -> Optional[float]:
        """Working set / limit: what the OOM killer compares; None without a limit."""
        return self.working_set_bytes / self.limit_bytes if self.limit_bytes else None


@dataclass(frozen=True)
class HostMemory:
    total_bytes: int
    available_bytes: Optional[int]  # None: meminfo has neither MemAvailable nor MemFree
    shmem_bytes: Optional[int]  # None: meminfo has no Shmem line


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    comm: str
    used_bytes: int


@dataclass(frozen=True)
class GpuDevice:
    gpu: str  # NVML index; "<index>/<mig index>" for a MIG instance
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: Optional[int]  # None where memory info v2 is not supported
    processes: Tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class GpuSnapshot:
    driver_version: str
    devices: List[GpuDevice]
    errors: List[str] = field(default_factory=list)  # GPUs skipped, and why


@dataclass(frozen=True)
class OomKill:
    seq: int  # the kernel log's sequence number of the "Killed process" record
    boot_usec: int  # microseconds after boot
    pid: int  # as the host sees it
    comm: str
    task_memcg: str  # the victim's cgroup ('' when the kernel did not say)
    oom_memcg: str  # the cgroup whose limit was hit ('' for a system-wide OOM)
    constraint: str  # CONSTRAINT_MEMCG, CONSTRAINT_NONE (system), ...
    anon_rss_bytes: Optional[int]
    file_rss_bytes: Optional[int]
    shmem_rss_bytes: Optional[int]

    @property
    def pod_uid(self) -> str:
        return pod_uid_in_cgroup(self.task_memcg)

    @property
    def pod_cgroup(self) -> str:
        """Up to the pod's own directory, whatever follows its UID (.slice); '' outside a pod."""
        match = re.search(POD_UID_IN_CGROUP.pattern + "[^/]*", self.task_memcg)
        return self.task_memcg[: match.end()] if match else ""


@dataclass(frozen=True)
class OomReports:
    new: Tuple[OomKill, ...]  # kills reported since the last run (in order)
    lost: int  # records the kernel overwrote before we read them (EPIPE): kills may be missing


@dataclass(frozen=True)
class SysvSegment:
    key: int
    shmid: int
    size_bytes: int
    nattch: int
    cpid: int
    rss_bytes: int
    lpid: int = 0
    # Nothing attached, its creator and last user (if any) gone: set by the collector (/proc);
    # a pid we cannot see (0: another PID namespace) or still there leaves it False.
    orphan: bool = False


@dataclass(frozen=True)
class SysvShm:
    segments: List[SysvSegment]
    shmmax_bytes: Optional[int]
    shmall_bytes: Optional[int]
    shmmni: Optional[int]
    # Node mode: which IPC namespace ("ipc:[4026531839]"), whose (a pod's or a container's),
    # and whether it could be read (if not: no segments, limits None). A sidecar's: "", True.
    namespace: str = ""
    pod_uid: str = ""
    container_id: str = ""
    readable: bool = True
    error: Optional[str] = None

    @property
    def total_bytes(self) -> int:
        return sum(s.size_bytes for s in self.segments)

    @property
    def resident_bytes(self) -> int:
        return sum(s.rss_bytes for s in self.segments)

    @property
    def orphans(self) -> int:
        return sum(1 for s in self.segments if s.orphan)


@dataclass(slots=True)
class Segment:
    name: str  # path below the mount as found (may hold any bytes, as surrogates)
    cls: str
    state: str  # linked | hidden | orphan | unverified (DESIGN.md, "Segment states")
    allocated_bytes: int
    apparent_bytes: int
    mtime: float = 0.0
    holders: Tuple[int, ...] = ()
    key: Tuple[int, int] = (0, 0)  # (st_dev, st_ino)


STATES = ("linked", "hidden", "orphan", "unverified")
# A listed file is one int (~40 bytes; a tuple of its fields ~200): class (index in
# CLASS_NAMES), listed by the last full scan, which walk saw it last (a parity bit), inode,
# mtime (s), blocks, apparent size; the sizes (may be 0) lie highest: an empty file's is short.
KNOWN, SEEN, INO_SHIFT, INO_MASK = 1 << 5, 1 << 6, 7, (1 << 64) - 1


def pack(cls: int, flags: int, ino: int, mtime: float, blocks: int, size: int) -> int:
    mtime = min(max(int(mtime), 0), (1 << 40) - 1)
    row = cls | flags | ino << INO_SHIFT | mtime << 71
    return row | min(blocks, (1 << 48) - 1) << 111 | size << 159


def unpack(row: int) -> Tuple[int, int, int, int, int]:
    """-> (class index, inode, mtime, allocated bytes, apparent bytes)."""
    ino, mtime = row >> INO_SHIFT & INO_MASK, row >> 71 & (1 << 40) - 1
    return row & 31, ino, mtime, (row >> 111 & (1 << 48) - 1) * 512, row >> 159


@dataclass
class MountInventory:
    mount: str
    error: Optional[str] = None
    dev: int = 0
    # Path below the mount -> row (`pack`): the collector's listing, updated in place by its
    # next run (one copy of 100,000 rows, not two): read it, with `states`, before then.
    listed: Dict[str, int] = field(default_factory=dict)
    states: bytes = b""  # each listed row's index in STATES, in `listed`'s order
    held: Dict[int, Tuple[int, ...]] = field(default_factory=dict)  # inode -> pids
    hidden: List[Segment] = field(default_factory=list)
    other_entries: Dict[str, int] = field(default_factory=dict)
    used_bytes: int = 0
    unattributed_bytes: int = 0
    process_bytes: Dict[int, int] = field(default_factory=dict)
    # Since the last run, from the listings: (class, "created" | "deleted") -> count.
    events: Dict[Tuple[str, str], int] = field(default_factory=dict)
    # Past --inventory.max-segments: class -> (count, allocated, apparent) of the listed
    # files, kept instead of `listed` (no names, no owner join: all 'unverified').
    degraded: Optional[Dict[str, Tuple[int, int, int]]] = None

    @property
    def files(self) -> int:
        """Regular files listed: a row each, or counted by class past the cap."""
        counted = sum(count for count, _, _ in (self.degraded or {}).values())
        return len(self.states) + counted

    def rows(self) -> Iterator[Segment]:
        yield from self.hidden
        for (name, row), state in zip(self.listed.items(), self.states):
            cls, ino, mtime, allocated, apparent = unpack(row)
            seg = (name, CLASS_NAMES[cls], STATES[state], allocated, apparent, mtime)
            yield Segment(*seg, self.held.get(ino, ()), (self.dev, ino))


@dataclass
class Inventory:
    mounts: List[MountInventory]
    comms: Dict[int, str]
    proc_unreadable: Optional[int]  # None: hidden processes exist, but were not counted
    processes_scanned: int
    # When it was made; not compared: two inventories of the same segments are equal.
    wall_time: float = field(default_factory=time.time, compare=False)
    pods: Dict[int, str] = field(default_factory=dict)  # pid -> pod UID, in node mode
    # Every process that could hold a segment was inspected; if not, why, for the log and check.
    owners_complete: bool = True
    unproven: List[str] = field(default_factory=list)
    # memfd regions mapped or held (state "hidden"), and each holder's memory cgroup path.
    memfd: List[Segment] = field(default_factory=list)
    # pid -> class -> (count, allocated) past its largest few regions (each in one holder's)
    memfd_rest: Dict[int, Dict[str, Tuple[int, int]]] = field(default_factory=dict)
    cgroup_of: Dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    source: str
    result: object  # the source's typed result; None when the run failed
    error: Optional[str]
    duration: float
    full: bool = True  # False for an event-driven quick run

    @property
    def success(self) -> bool:
        return self.error is None
