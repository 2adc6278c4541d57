"""The observations: what each source returns, typed; the model step joins them."""

import re
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, NewType, Optional, Tuple

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
class MountInstance:
    """Which mount is at a path: a tmpfs mounted again there is another (its peaks start
    afresh). Device numbers and mountinfo IDs go to the next mount at once; the unique mount
    ID (statx, Linux 6.8) never."""

    device: str  # mountinfo's major:minor
    mount_id: int  # mountinfo's
    unique_id: Optional[int] = None  # None before Linux 6.8


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
    instance: Optional[MountInstance] = None  # None: not a mount point, or not known
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


@dataclass(frozen=True, slots=True)
class Segment:
    """One segment, as the summaries and `check` see it (MountInventory.rows makes them)."""

    name: str  # path below the mount as found (may hold any bytes, as surrogates)
    cls: str
    state: str  # linked | hidden | orphan | unverified (docs/architecture.md, "Segments and owners")
    allocated_bytes: int
    apparent_bytes: int
    mtime: float = 0.0
    holders: Tuple[int, ...] = ()  # pids, sorted
    key: Tuple[int, int] = (0, 0)  # (st_dev, st_ino)


STATES = ("linked", "hidden", "orphan", "unverified")

# A listed file's row: one int (~40 bytes; a tuple of its fields ~200). Row reads and makes it.
PackedRow = NewType("PackedRow", int)


class Row:
    """The fields of a PackedRow, from its lowest bit: the class (5 bits: an index in
    CLASS_NAMES), `known` (listed before a full scan read /proc), the inode (64 bits), mtime
    in whole seconds (40), the blocks (48: allocated = blocks x 512) and the apparent size
    (the rest). The sizes, which may be 0, lie highest: an empty file's int is short. A row
    changes only when its file does: every inventory published since shares its int."""

    _CLASS_MASK = (1 << 5) - 1
    KNOWN = 1 << 5
    _INODE_AT, _INODE_MASK = 6, (1 << 64) - 1
    _MTIME_AT, _MTIME_MASK = 70, (1 << 40) - 1
    _BLOCKS_AT, _BLOCKS_MASK = 110, (1 << 48) - 1
    _SIZE_AT = 158

    @staticmethod
    def pack(
        class_index: int,
        inode: int,
        mtime: float,
        blocks: int,
        apparent_bytes: int,
        known: bool = False,
    ) -> PackedRow:
        """mtime and blocks are clamped to their bits."""
        clamped_mtime = min(max(int(mtime), 0), Row._MTIME_MASK)
        row = class_index | (Row.KNOWN if known else 0)
        row |= inode << Row._INODE_AT | clamped_mtime << Row._MTIME_AT
        row |= min(blocks, Row._BLOCKS_MASK) << Row._BLOCKS_AT
        return PackedRow(row | apparent_bytes << Row._SIZE_AT)

    @staticmethod
    def class_index(row: PackedRow) -> int:
        return row & Row._CLASS_MASK

    @staticmethod
    def class_name(row: PackedRow) -> str:
        return CLASS_NAMES[row & Row._CLASS_MASK]

    @staticmethod
    def known(row: PackedRow) -> bool:
        return bool(row & Row.KNOWN)

    @staticmethod
    def marked_known(row: PackedRow) -> PackedRow:
        return PackedRow(row | Row.KNOWN)

    @staticmethod
    def inode(row: PackedRow) -> int:
        return row >> Row._INODE_AT & Row._INODE_MASK

    @staticmethod
    def mtime(row: PackedRow) -> int:
        return row >> Row._MTIME_AT & Row._MTIME_MASK

    @staticmethod
    def allocated_bytes(row: PackedRow) -> int:
        return (row >> Row._BLOCKS_AT & Row._BLOCKS_MASK) * 512

    @staticmethod
    def apparent_bytes(row: PackedRow) -> int:
        return row >> Row._SIZE_AT


@dataclass(frozen=True)
class ClassTotals:
    """Files of one class (and state) counted together: past the cap, and in summaries."""

    count: int = 0
    allocated_bytes: int = 0
    apparent_bytes: int = 0


@dataclass(slots=True)
class ClassTally:
    """Files of one class (and state) counted while a pass runs (a walk past the cap, a
    summary): one object added to per file, made a ClassTotals once at the end; not frozen,
    which would cost each file of a storm a new object."""

    count: int = 0
    allocated_bytes: int = 0
    apparent_bytes: int = 0

    @staticmethod
    def of(totals: ClassTotals) -> "ClassTally":
        """A tally that goes on from these totals."""
        return ClassTally(
            count=totals.count,
            allocated_bytes=totals.allocated_bytes,
            apparent_bytes=totals.apparent_bytes,
        )

    def add(self, allocated_bytes: int, apparent_bytes: int) -> None:
        self.count += 1
        self.allocated_bytes += allocated_bytes
        self.apparent_bytes += apparent_bytes

    def totals(self) -> ClassTotals:
        return ClassTotals(
            count=self.count,
            allocated_bytes=self.allocated_bytes,
            apparent_bytes=self.apparent_bytes,
        )


@dataclass(frozen=True)
class MountInventory:
    """One mount's segments as one run found them. Published: nobody changes it after (its
    rows are the listing's at the time, in tuples that share the listing's names and ints)."""

    mount: str
    error: Optional[str] = None
    dev: int = 0
    # Each listed file: its path below the mount, its row, its state (an index in STATES),
    # in the same order.
    names: Tuple[str, ...] = ()
    packed: Tuple[PackedRow, ...] = ()
    states: bytes = b""
    held: Mapping[int, Tuple[int, ...]] = field(default_factory=dict)  # inode -> pids
    hidden: Tuple[Segment, ...] = ()
    other_entries: Mapping[str, int] = field(default_factory=dict)
    used_bytes: int = 0
    unattributed_bytes: int = 0
    process_bytes: Mapping[int, int] = field(default_factory=dict)
    # Since the last run, from the listings: (class, "created" | "deleted") -> count.
    events: Mapping[Tuple[str, str], int] = field(default_factory=dict)
    # Past --inventory.max-segments: class -> the listed files' totals, kept instead of
    # the rows (no names, no owner join: all 'unverified').
    degraded: Optional[Mapping[str, ClassTotals]] = None

    @property
    def files(self) -> int:
        """Regular files listed: a row each, or counted by class past the cap. (Asked of
        every mount at every publication: the common case costs no loop.)"""
        if self.degraded is None:
            return len(self.states)
        return len(self.states) + sum(t.count for t in self.degraded.values())

    def rows(self) -> Iterator[Segment]:
        """Every segment: the hidden ones, then each listed file."""
        yield from self.hidden
        for name, row, state in zip(self.names, self.packed, self.states):
            inode = Row.inode(row)
            yield Segment(
                name=name,
                cls=Row.class_name(row),
                state=STATES[state],
                allocated_bytes=Row.allocated_bytes(row),
                apparent_bytes=Row.apparent_bytes(row),
                mtime=Row.mtime(row),
                holders=self.held.get(inode, ()),
                key=(self.dev, inode),
            )


@dataclass(frozen=True)
class MemfdTotals:
    """A process's memfd regions of one class past its largest few."""

    count: int
    allocated_bytes: int


@dataclass(frozen=True)
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
    # pid -> class -> its regions past its largest few (each in one holder's only)
    memfd_rest: Dict[int, Dict[str, MemfdTotals]] = field(default_factory=dict)
    cgroup_of: Dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ProcessSample:
    """One of the exporter's own process_* samples (prometheus_client's ProcessCollector)."""

    name: str  # e.g. process_resident_memory_bytes
    value: float


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
