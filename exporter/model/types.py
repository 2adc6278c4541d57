"""The observations: what each source returns, typed, owned by the model. Sources make
them, the scheduler carries them, the model step joins them, exposition and check read them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from exporter.host.kube import POD_UID_IN_CGROUP, pod_uid_in_cgroup

Key = Tuple[int, int]  # (st_dev, st_ino)


@dataclass(frozen=True)
class Target:
    mount: str  # the mount point as the host sees it (read through --path.rootfs)
    labels: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MountSet:
    """What discovery published: the mounts, in order, with their node labels."""

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
    limit_source: str  # "cgroup", "flag" or "none"
    pod_uid: str = ""  # node mode: the pod this cgroup belongs to
    estimated: bool = False  # True: no cgroup was read; the workload's processes and shm (workload.py)
    # Node mode on v1: each container cgroup's own OOM kill count (path, count). v1 counts a
    # kill only in the victim's memcg, and the container's cgroup goes with the container:
    # the model keeps each one's highest count, so the pod's total survives it.
    child_oom_kills: Tuple[Tuple[str, int], ...] = ()

    @property
    def oom_risk_ratio(self) -> Optional[float]:
        """Working set / limit: what the OOM killer compares; None without a limit."""
        return self.working_set_bytes / self.limit_bytes if self.limit_bytes else None


@dataclass(frozen=True)
class HostMemory:
    total_bytes: int
    available_bytes: int
    shmem_bytes: int


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
        """The victim's pod cgroup (its path up to the pod's own directory); '' outside a pod."""
        match = POD_UID_IN_CGROUP.search(self.task_memcg)
        if not match:
            return ""
        end = self.task_memcg.find("/", match.end())
        return self.task_memcg if end < 0 else self.task_memcg[:end]


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
    name: str  # basename as found (may hold any bytes, as surrogates)
    cls: str
    state: str  # linked | hidden | orphan | unverified (DESIGN.md, "Segment states")
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


@dataclass
class Inventory:
    mounts: List[MountInventory]
    comms: Dict[int, str]
    # None: processes hidden from us exist, but could not be counted
    proc_unreadable: Optional[int]
    processes_scanned: int
    # When it was made; not compared: two inventories of the same segments are equal.
    wall_time: float = field(default_factory=time.time, compare=False)
    pods: Dict[int, str] = field(default_factory=dict)  # pid -> pod UID, in node mode
    # Every process that could hold a segment was inspected; if not, why, for the log and check.
    owners_complete: bool = True
    unproven: List[str] = field(default_factory=list)
    # memfd regions mapped or held (state "hidden"), and each holder's memory cgroup path.
    memfd: List[Segment] = field(default_factory=list)
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
