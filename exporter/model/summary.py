"""The inventory's data, and the per-mount summaries the model computes from it once per
inventory: totals by class and state, top K segments and processes, the oldest orphan,
leak candidates. Scrapes and `shmwatch check` render these; neither walks segments."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple

from exporter.model.types import MountInventory, Segment
from exporter.model.classes import NOT_LEAKS, removable


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
    leaked: List[Segment]  # orphans that count as leaks, largest first
    unverified: List[Segment]  # held by nobody we could inspect, largest first
    # The pids whose comm (and pod) the mount's series name: each top segment's first holder
    # (owner_label), each top process. The model makes the summary again when one changes.
    named_pids: FrozenSet[int] = frozenset()


def summarise(inv: MountInventory, top_k: int) -> SegmentSummary:
    totals: Dict[Tuple[str, str], Tuple[int, int, int]] = {}
    by_class: Dict[str, int] = {}
    for seg in inv.segments:
        count, allocated, apparent = totals.get((seg.cls, seg.state), (0, 0, 0))
        totals[seg.cls, seg.state] = (
            count + 1,
            allocated + seg.allocated_bytes,
            apparent + seg.apparent_bytes,
        )
        by_class[seg.cls] = by_class.get(seg.cls, 0) + seg.allocated_bytes
    largest = lambda s: (-s.allocated_bytes, s.name)  # noqa: E731
    orphans = [s for s in inv.segments if s.state == "orphan"]
    unverified = [s for s in inv.segments if s.state == "unverified"]
    hidden = [s.allocated_bytes for s in inv.segments if s.state == "hidden"]
    top = heapq.nsmallest(top_k, inv.segments, key=largest)
    top_processes = heapq.nsmallest(
        top_k, inv.process_bytes.items(), key=lambda kv: (-kv[1], kv[0])
    )
    return SegmentSummary(
        totals=totals,
        bytes_by_class=by_class,
        hidden_bytes=sum(hidden),
        hidden_count=len(hidden),
        top=top,
        top_processes=top_processes,
        # The age alert says "remove it": only for what may be removed.
        oldest_orphan_mtime=min(
            (s.mtime for s in orphans if removable(s.cls)), default=None
        ),
        leaked=sorted((s for s in orphans if s.cls not in NOT_LEAKS), key=largest),
        unverified=sorted(
            (s for s in unverified if s.cls not in NOT_LEAKS), key=largest
        ),
        named_pids=frozenset(
            [seg.holders[0] for seg in top if seg.holders]
            + [pid for pid, _ in top_processes]
        ),
    )


def owner_label(holders: Iterable[int], comms: Dict[int, str]) -> str:
    """'python[1234]', 'python[1234]+3' for four holders, '' for none."""
    holders = list(holders)
    if not holders:
        return ""
    first = holders[0]
    text = f"{comms.get(first, 'unknown')}[{first}]"
    return text + (f"+{len(holders) - 1}" if len(holders) > 1 else "")


def memfd_summary(
    regions: List[Segment], top_k: int
) -> Tuple[Dict[str, Tuple[int, int]], List[Tuple[int, int]]]:
    """memfd regions -> ({class: (count, allocated)}, top K (pid, allocated it holds))."""
    by_class: Dict[str, Tuple[int, int]] = {}
    by_pid: Dict[int, int] = {}
    for seg in regions:
        count, allocated = by_class.get(seg.cls, (0, 0))
        by_class[seg.cls] = (count + 1, allocated + seg.allocated_bytes)
        for pid in seg.holders:
            by_pid[pid] = by_pid.get(pid, 0) + seg.allocated_bytes
    top = heapq.nsmallest(top_k, by_pid.items(), key=lambda kv: (-kv[1], kv[0]))
    return by_class, top
