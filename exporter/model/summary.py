"""Per-mount summaries made per inventory, so renders walk no segments; the shm budget:
the one formula /metrics and `shmwatch check` both report."""

import bisect
import heapq
from collections import Counter
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
)

from exporter.model.classes import NOT_LEAKS, REMOVABLE
from exporter.model.types import CgroupMemory, ClassTally, ClassTotals, Inventory
from exporter.model.types import MemfdTotals
from exporter.model.types import MountInventory, MountUsage, Segment

LISTED = 50  # leaked and unverified segments named, largest first (counts: `totals`)
# A series names a segment (shmwatch_top_segment_bytes) once its last modification is this
# old, an orphan once it is ORPHAN_NAMED_AFTER_SECONDS old (the default --inventory-interval):
# a segment that lives seconds never gets a series of its own.
NAMED_AFTER_SECONDS = 60.0
ORPHAN_NAMED_AFTER_SECONDS = 15.0
T = TypeVar("T")


@dataclass(frozen=True)
class SegmentSummary:
    totals: Dict[Tuple[str, str], ClassTotals]  # by (class, state)
    bytes_by_class: Dict[str, int]
    hidden_bytes: int
    hidden_count: int
    # The segments a series may name (named_now), --segments.top-k of them in named_first's
    # order.
    top: List[Segment]
    top_processes: List[Tuple[int, int]]  # (pid, bytes)
    oldest_orphan_mtime: Optional[float]
    leaked: List[Segment]  # the LISTED largest leaks of removable classes and of others
    unverified: List[Segment]  # the LISTED largest
    # The pids whose comm (and pod) the mount's series name: each top segment's first holder
    # (owner_comm), each top process. The model makes the summary again when one changes.
    named_pids: FrozenSet[int] = frozenset()
    degraded: bool = False  # past --inventory.max-segments: totals by class only


def summarise(
    inv: MountInventory, top_k: int, now: Optional[float] = None
) -> SegmentSummary:
    """One pass over the segments, made one at a time; only the kept ones stay. The segments
    a series may name (`top`) are those old enough at `now` (None: every one; named_now)."""
    # A degraded mount's files, counted by class past the cap, as 'unverified' (it has no
    # rows; its hidden segments are tallied beside them).
    tallies = {
        (cls, "unverified"): ClassTally.of(t) for cls, t in (inv.degraded or {}).items()
    }
    top = _First(top_k, named_first)
    unverified = _First(LISTED)
    oldest: Optional[float] = None
    # Segments of removable classes, and the others.
    leaked = {True: _First(LISTED), False: _First(LISTED)}
    for seg in inv.rows():
        _tally_of(tallies, seg).add(seg.allocated_bytes, seg.apparent_bytes)
        if now is None or named_now(seg, now):
            top.add(seg)
        if _keep_unheld(seg, leaked, unverified):
            oldest = seg.mtime if oldest is None else min(oldest, seg.mtime)
    totals = {key: tally.totals() for key, tally in tallies.items()}
    by_class: Dict[str, int] = {}
    for (cls, _), t in totals.items():
        by_class[cls] = by_class.get(cls, 0) + t.allocated_bytes
    top_processes = heapq.nsmallest(top_k, inv.process_bytes.items(), key=_most)
    named_segments = top.first()
    named = {seg.holders[0] for seg in named_segments if seg.holders}
    return SegmentSummary(
        totals=totals,
        bytes_by_class=by_class,
        hidden_bytes=sum(
            t.allocated_bytes for (_, s), t in totals.items() if s == "hidden"
        ),
        hidden_count=len(inv.hidden),
        top=named_segments,
        top_processes=top_processes,
        oldest_orphan_mtime=oldest,
        leaked=sorted(leaked[True].first() + leaked[False].first(), key=_largest),
        unverified=unverified.first(),
        named_pids=frozenset(named.union(pid for pid, _ in top_processes)),
        degraded=inv.degraded is not None,
    )


def _tally_of(tallies: Dict[Tuple[str, str], ClassTally], seg: Segment) -> ClassTally:
    """The tally of the segment's class and state, made when it is the first."""
    tally = tallies.get((seg.cls, seg.state))
    if tally is None:
        tally = tallies[seg.cls, seg.state] = ClassTally()
    return tally


def _keep_unheld(
    seg: Segment, leaked: Dict[bool, "_First"], unverified: "_First"
) -> bool:
    """Keeps a leak (by whether its class is removable) or an unverified segment among the
    LISTED largest, for `check` to name; True for an orphan of a removable class, the one
    the age alert says to remove."""
    if seg.cls in NOT_LEAKS:
        return False
    if seg.state == "orphan":
        leaked[seg.cls in REMOVABLE].add(seg)
        return seg.cls in REMOVABLE
    if seg.state == "unverified":
        unverified.add(seg)
    return False


def _most(pid_bytes: Tuple[int, int]) -> Tuple[int, int]:
    return -pid_bytes[1], pid_bytes[0]


def _largest(seg: Segment) -> Tuple[int, str]:
    return -seg.allocated_bytes, seg.name


def named_now(seg: Segment, now: float) -> bool:
    """Whether a series may name the segment: an orphan last modified ORPHAN_NAMED_AFTER_SECONDS
    ago (a crashed engine's leak is named by the inventory that calls it orphan, or within one
    inventory interval of its making), any other segment NAMED_AFTER_SECONDS ago. A segment
    that lives seconds never is, nor one whose time is not known (0: an unlinked segment only
    mapped, without CAP_SYS_ADMIN to stat it)."""
    wait = ORPHAN_NAMED_AFTER_SECONDS if seg.state == "orphan" else NAMED_AFTER_SECONDS
    return 0 < seg.mtime <= now - wait


def named_first(seg: Segment) -> Tuple[bool, int, str]:
    """Which segments a series names first: leaks (orphans of a class that leaks: what to
    remove), then the largest."""
    leak = seg.state == "orphan" and seg.cls not in NOT_LEAKS
    return not leak, -seg.allocated_bytes, seg.name


class _First:
    """The k first segments by `key` (ties in the order met), kept while a pass meets them
    one at a time: each appended, and the list sorted and cut back to k whenever it holds
    2k + 64 (at most that many held). A storm's segments cost a key each and the k kept one
    more at each cut (not a bisection with its keys per segment)."""

    def __init__(
        self, k: int, key: Callable[[Segment], Tuple[Any, ...]] = _largest
    ) -> None:
        self.k, self.key = k, key
        self._held: List[Segment] = []

    def add(self, seg: Segment) -> None:
        self._held.append(seg)
        if len(self._held) >= 2 * self.k + 64:
            self._cut()

    def first(self) -> List[Segment]:
        """The k first, in order: the list itself, handed over (the summary's), so nothing
        is added after."""
        self._cut()
        held, self._held = self._held, []
        return held

    def _cut(self) -> None:
        self._held.sort(key=self.key)
        del self._held[self.k :]


def named_on_exporter(
    summaries: Sequence[Tuple[T, SegmentSummary]], top_k: int
) -> List[Tuple[T, Segment]]:
    """The segments the exporter names (shmwatch_top_segment_bytes), each with its mount's
    key: --segments.top-k of them across every mount (not per mount: a node's series stay
    bounded however many pods it runs), orphans first."""
    chosen: List[Tuple[T, Segment]] = []
    for key, summary in summaries:
        for seg in summary.top:
            if (
                len(chosen) < top_k
                or chosen
                and named_first(seg) < named_first(chosen[-1][1])
            ):
                bisect.insort(chosen, (key, seg), key=lambda pair: named_first(pair[1]))
                del chosen[top_k:]
    return chosen


def owner_comm(holders: Sequence[int], comms: Dict[int, str]) -> str:
    """The process name (comm) of a segment's first holder; 'unknown' when not read, '' for
    none. Not its pid: a series per pid would be a series per restart."""
    if not holders:
        return ""
    return comms.get(holders[0], "unknown")


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
