"""Per-mount summaries made per inventory, so renders walk no segments; the shm budget:
the one formula /metrics and `shmwatch check` both report."""

import bisect
import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from exporter.model.classes import NOT_LEAKS, REMOVABLE
from exporter.model.types import CgroupMemory, ClassTotals, Inventory, MemfdTotals
from exporter.model.types import MountInventory, MountUsage, Segment

LISTED = 50  # leaked and unverified segments named, largest first (counts: `totals`)
NO_FILES = ClassTotals()


@dataclass(frozen=True)
class SegmentSummary:
    totals: Dict[Tuple[str, str], ClassTotals]  # by (class, state)
    bytes_by_class: Dict[str, int]
    hidden_bytes: int
    hidden_count: int
    top: List[Segment]
    top_processes: List[Tuple[int, int]]  # (pid, bytes)
    oldest_orphan_mtime: Optional[float]
    leaked: List[Segment]  # the LISTED largest leaks of removable classes and of others
    unverified: List[Segment]  # the LISTED largest
    # The pids whose comm (and pod) the mount's series name: each top segment's first holder
    # (owner_label), each top process. The model makes the summary again when one changes.
    named_pids: FrozenSet[int] = frozenset()
    degraded: bool = False  # past --inventory.max-segments: totals by class only


def summarise(inv: MountInventory, top_k: int) -> SegmentSummary:
    """One pass over the segments, made one at a time; only the kept ones stay."""
    totals = {(cls, "unverified"): t for cls, t in (inv.degraded or {}).items()}
    top: List[Segment] = []
    unverified: List[Segment] = []
    oldest: Optional[float] = None
    # segments of removable classes, and the others
    leaked: Dict[bool, List[Segment]] = {True: [], False: []}
    for seg in inv.rows():
        key = seg.cls, seg.state
        was = totals.get(key, NO_FILES)
        totals[key] = was.plus(1, seg.allocated_bytes, seg.apparent_bytes)
        _keep(top, seg, top_k)
        if seg.cls in NOT_LEAKS:
            continue
        if seg.state == "orphan":
            _keep(leaked[seg.cls in REMOVABLE], seg, LISTED)
            if seg.cls in REMOVABLE:  # the age alert says "remove it": only for those
                oldest = seg.mtime if oldest is None else min(oldest, seg.mtime)
        elif seg.state == "unverified":
            _keep(unverified, seg, LISTED)
    by_class: Dict[str, int] = {}
    for (cls, _), t in totals.items():
        by_class[cls] = by_class.get(cls, 0) + t.allocated_bytes
    top_processes = heapq.nsmallest(top_k, inv.process_bytes.items(), key=_most)
    named = {seg.holders[0] for seg in top if seg.holders}
    return SegmentSummary(
        totals=totals,
        bytes_by_class=by_class,
        hidden_bytes=sum(
            t.allocated_bytes for (_, s), t in totals.items() if s == "hidden"
        ),
        hidden_count=len(inv.hidden),
        top=top,
        top_processes=top_processes,
        oldest_orphan_mtime=oldest,
        leaked=sorted(leaked[True] + leaked[False], key=_largest),
        unverified=unverified,
        named_pids=frozenset(named.union(pid for pid, _ in top_processes)),
        degraded=inv.degraded is not None,
    )


def _most(pid_bytes: Tuple[int, int]) -> Tuple[int, int]:
    return -pid_bytes[1], pid_bytes[0]


def _largest(seg: Segment) -> Tuple[int, str]:
    return -seg.allocated_bytes, seg.name


def _keep(kept: List[Segment], seg: Segment, k: int) -> None:
    """Keeps the k largest, largest first; most segments of a storm cost one comparison."""
    if len(kept) < k or kept and _largest(seg) < _largest(kept[-1]):
        bisect.insort(kept, seg, key=_largest)
        del kept[k:]


def owner_label(holders: Sequence[int], comms: Dict[int, str]) -> str:
    """'python[1234]', 'python[1234]+3' for four holders, '' for none."""
    if not holders:
        return ""
    more = f"+{len(holders) - 1}" if len(holders) > 1 else ""
    return f"{comms.get(holders[0], 'unknown')}[{holders[0]}]{more}"


@dataclass(frozen=True)
class MemfdSummary:
    by_class: Dict[str, MemfdTotals]
    top: List[Tuple[int, int]]  # the top K (pid, bytes of the regions it holds)


def memfd_summary(inv: Inventory, top_k: int) -> MemfdSummary:
    """The memfd regions by class, and the processes holding the most."""
    by_class: Dict[str, MemfdTotals] = {}
    by_pid: Dict[int, int] = Counter()

    def add(cls: str, count: int, size: int, holders: Sequence[int]) -> None:
        was = by_class.get(cls, MemfdTotals(count=0, allocated_bytes=0))
        total = MemfdTotals(
            count=was.count + count, allocated_bytes=was.allocated_bytes + size
        )
        by_class[cls] = total
        for pid in holders:
            by_pid[pid] += size

    for seg in inv.memfd:
        add(seg.cls, 1, seg.allocated_bytes, seg.holders)
    for pid, rest in inv.memfd_rest.items():
        for cls, t in rest.items():
            add(cls, t.count, t.allocated_bytes, (pid,))
    top = heapq.nsmallest(top_k, by_pid.items(), key=_most)
    return MemfdSummary(by_class=by_class, top=top)


@dataclass(frozen=True)
class ShmBudget:
    fillable_bytes: int  # min(tmpfs size, --shm.size-limit)
    effective_bytes: int  # fillable, and no more than the memory limit leaves for shm
    projection: Optional[float]  # (working set - shm used + fillable) / cgroup limit
    room_bytes: Optional[int]  # what the memory limit leaves for shm; None: no limit


def shm_budget(
    m: MountUsage,
    cgroup: Optional[CgroupMemory],
    size_limit: Optional[int] = None,
    memory_limit: Optional[int] = None,
) -> ShmBudget:
    """The sizeLimit counts because older kubelets leave the tmpfs at half of node RAM and
    enforce it by eviction; the memory limit because tmpfs pages are charged to the cgroup,
    beside everything else the pod uses. `memory_limit` stands in where no cgroup was read."""
    fillable = min(m.size_bytes, size_limit) if size_limit else m.size_bytes
    if cgroup is not None and cgroup.limit_bytes:
        non_shm = max(0, cgroup.working_set_bytes - m.used_bytes)
        room = max(0, cgroup.limit_bytes - non_shm)
        projection = (non_shm + fillable) / cgroup.limit_bytes
        return ShmBudget(fillable, min(fillable, room), projection, room)
    if cgroup is None and memory_limit:
        return ShmBudget(fillable, min(fillable, memory_limit), None, memory_limit)
    return ShmBudget(fillable, fillable, None, None)


def cgroups_by_pod(cgroups: Sequence[CgroupMemory]) -> Dict[str, CgroupMemory]:
    """The cgroup a mount's pages are charged to, by the mount's pod UID: a pod's emptyDir to
    its pod's cgroup, any other mount ("") to the watched cgroup of no pod (the sidecar's
    workload; in node mode none, so the host's /dev/shm is charged to no pod). First wins."""
    return {cgroup.pod_uid: cgroup for cgroup in reversed(cgroups)}
