"""Per-mount summaries, made once per inventory: totals by class and state, top K
segments and processes, the oldest orphan, leak candidates; renders walk no segments."""

import bisect
import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from exporter.model.types import Inventory, MountInventory, Segment
from exporter.model.classes import NOT_LEAKS, REMOVABLE


LISTED = 50  # leaked and unverified segments named, largest first (counts: `totals`)


@dataclass(frozen=True)
class SegmentSummary:
    # (class, state) -> (count, allocated, apparent)
    totals: Dict[Tuple[str, str], Tuple[int, int, int]]
    bytes_by_class: Dict[str, int]
    hidden_bytes: int
    hidden_count: int
    top: List[Segment]
    top_processes: List[Tuple[int, int]]  # (pid, bytes)
    oldest_orphan_mtime: Optional[float]
    # The largest LISTED orphans that count as leaks, of removable classes and of others;
    # the largest LISTED unverified ones.
    leaked: List[Segment]
    unverified: List[Segment]
    # The pids whose comm (and pod) the mount's series name: each top segment's first holder
    # (owner_label), each top process. The model makes the summary again when one changes.
    named_pids: FrozenSet[int] = frozenset()
    # Past --inventory.max-segments: counts and bytes by class only.
    degraded: bool = False


def summarise(inv: MountInventory, top_k: int) -> SegmentSummary:
    """One pass over the segments, made one at a time; only the kept ones stay."""
    totals = {(cls, "unverified"): row for cls, row in (inv.degraded or {}).items()}
    top, unverified, oldest = [], [], None
    leaked = {True: [], False: []}  # segments of removable classes, and the others
    for seg in inv.rows():
        key = seg.cls, seg.state
        n, size, apparent = totals.get(key, (0, 0, 0))
        totals[key] = (n + 1, size + seg.allocated_bytes, apparent + seg.apparent_bytes)
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
    for (cls, _), (_, allocated, _) in totals.items():
        by_class[cls] = by_class.get(cls, 0) + allocated
    top_processes = heapq.nsmallest(top_k, inv.process_bytes.items(), key=_most)
    return SegmentSummary(
        totals=totals,
        bytes_by_class=by_class,
        hidden_bytes=sum(a for (_, s), (_, a, _) in totals.items() if s == "hidden"),
        hidden_count=len(inv.hidden),
        top=top,
        top_processes=top_processes,
        oldest_orphan_mtime=oldest,
        leaked=sorted(leaked[True] + leaked[False], key=_largest),
        unverified=unverified,
        named_pids=frozenset(
            [seg.holders[0] for seg in top if seg.holders]
            + [pid for pid, _ in top_processes]
        ),
        degraded=inv.degraded is not None,
    )


def _most(pid_bytes: Tuple[int, int]) -> Tuple[int, int]:
    return -pid_bytes[1], pid_bytes[0]


def _largest(seg: Segment) -> Tuple[int, str]:
    return -seg.allocated_bytes, seg.name


def _keep(kept: List[Segment], seg: Segment, k: int) -> None:
    """Keeps the k largest, largest first. Most segments of a storm are no larger than the
    last kept: one comparison."""
    if len(kept) < k or kept and _largest(seg) < _largest(kept[-1]):
        bisect.insort(kept, seg, key=_largest)
        del kept[k:]


def owner_label(holders: Sequence[int], comms: Dict[int, str]) -> str:
    """'python[1234]', 'python[1234]+3' for four holders, '' for none."""
    if not holders:
        return ""
    more = f"+{len(holders) - 1}" if len(holders) > 1 else ""
    return f"{comms.get(holders[0], 'unknown')}[{holders[0]}]{more}"


def memfd_summary(inv: Inventory, top_k: int) -> tuple:
    """memfd regions -> ({class: (count, allocated)}, top K (pid, allocated it holds))."""
    regions = [(seg.cls, 1, seg.allocated_bytes, seg.holders) for seg in inv.memfd]
    for pid, rest in inv.memfd_rest.items():
        regions += [(cls, n, size, (pid,)) for cls, (n, size) in rest.items()]
    by_class: Dict[str, Tuple[int, int]] = {}
    by_pid: Dict[int, int] = Counter()
    for cls, n, size, holders in regions:
        count, allocated = by_class.get(cls, (0, 0))
        by_class[cls] = (count + n, allocated + size)
        for pid in holders:
            by_pid[pid] += size
    return by_class, heapq.nsmallest(top_k, by_pid.items(), key=_most)
