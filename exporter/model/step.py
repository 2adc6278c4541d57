"""Observations in, one Model out for /metrics and check; summaries per inventory."""

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Optional, Sequence, Tuple

from exporter.host.kube import pod_uid_in_cgroup, pod_uid_of_mount
from exporter.model.state import MountStates, StateStore
from exporter.model.summary import SegmentSummary, ShmBudget, summarise
from exporter.model.summary import cgroups_by_pod, shm_budget
from exporter.model.types import CgroupMemory, GpuSnapshot, HostMemory, OomKill, SysvShm
from exporter.model.types import Inventory, MountInventory, MountUsage, Observation

log = logging.getLogger(__name__)

OOM_LOG = "OOM kill: pid %d (%s) in %s (limit of %s hit): anon-rss %s, shmem-rss %s; shm used %s%s"


@dataclass(frozen=True)
class SourceStatus:
    name: str
    success: bool = False  # the defaults: a source that has not answered yet
    duration: float = 0.0
    error: Optional[str] = None


@dataclass(frozen=True)
class MountView:
    mount: str
    labels: Dict[str, str]  # node mode: pod_uid, volume, container_id; else {}
    usage: Optional[MountUsage]  # None when shm_mount is off, failed, or has not run
    peak_bytes: Optional[int]
    max_used_bytes: Optional[int]  # the highest since first seen (None: no usage)
    max_used_at: Optional[float]  # when it was first reached
    inventory: Optional[MountInventory]  # None when segments is off, failed, or not run
    summary: Optional[SegmentSummary]
    cgroup: Optional[CgroupMemory]  # the memory cgroup its pages are charged to
    budget: Optional[ShmBudget]  # None without usage
    # False: the memory limit is unknown, so is the effective size (/metrics omits it).
    budget_complete: bool = True


@dataclass(frozen=True)
class OomCount:
    cgroup: str
    pod_uid: str
    kills: int  # max(kernel log's kills below the cgroup, its counters'); never down


@dataclass(frozen=True)
class Model:
    node_mode: bool
    statuses: List[SourceStatus]  # in source order
    mounts: List[MountView]
    inventory: Optional[Inventory]  # process-level facts: comms, pods, unreadable, time
    cgroups: List[CgroupMemory]
    host_memory: Optional[HostMemory]
    sysv: List[SysvShm]  # one per IPC namespace (one in a sidecar); [] when not read
    gpu: Optional[GpuSnapshot]
    process_samples: List[Tuple[str, float]]
    states: MountStates
    oom_kills: List[OomCount] = field(default_factory=list)
    # The newest OOM kills (oldest first), each with its pod's shm use when it was seen.
    recent_oom_kills: List[Tuple[OomKill, Optional[int]]] = field(default_factory=list)

    def result_ok(self, source: str) -> bool:
        return any(s.name == source and s.success for s in self.statuses)

    @cached_property
    def shmem_unexplained(self) -> Dict[str, int]:
        """Per cgroup read: shmem less what its mounts, its IPC namespace's SysV RSS
        and memfds held from it or below explain. An estimate: a page is charged to its
        first toucher, a memfd held from two counts in both. {}: memfds unknown."""
        inventory, node_mode = self.inventory, self.node_mode
        if inventory is None:
            return {}
        # id(cgroup), ("sysv", pod UID in node mode) or cgroup path -> bytes
        explained: Dict[object, int] = Counter()
        for v in self.mounts:
            if v.cgroup is not None and v.usage is not None and not v.usage.error:
                explained[id(v.cgroup)] += v.usage.used_bytes
        for s in self.sysv:
            if s.readable:
                explained["sysv", s.pod_uid if node_mode else ""] += s.resident_bytes
        regions = [(seg.holders, seg.allocated_bytes) for seg in inventory.memfd]
        for pid, rest in inventory.memfd_rest.items():
            regions.append(((pid,), sum(size for _, size in rest.values())))
        for holders, size in regions:
            held_in = {inventory.cgroup_of.get(pid) for pid in holders} - {None}
            # once per cgroup the region is held from or below
            for path in {p for c in held_in for p in _lineage(c)}:
                explained[path] += size
        out = {}
        for c in self.cgroups:
            if c.estimated or c.shmem_bytes is None:
                continue
            known = explained[id(c)] + explained["sysv", c.pod_uid if node_mode else ""]
            known += explained[c.cgroup.rstrip("/") or "/"]
            out[c.cgroup] = max(0, c.shmem_bytes - known)
        return out


class ModelStep:
    def __init__(
        self,
        sources: Sequence,
        discovery,
        state: StateStore,
        top_k: int = 10,
        shm_size_limit: Optional[int] = None,
        memory_limit: Optional[int] = None,
    ):
        self.discovery, self.state, self.top_k = discovery, state, top_k
        self.node_mode, self.shm_size_limit = discovery.node_mode, shm_size_limit
        # --memory.limit-bytes is the one workload's limit: it means nothing per pod.
        self.memory_limit = None if self.node_mode else memory_limit
        self._lock = threading.Lock()
        # source -> its latest Observation or None, in render order (discovery: node mode)
        self._latest = dict.fromkeys(s.name for s in sources if s.reports_status)
        self._summaries: Dict[str, SegmentSummary] = {}  # the latest inventory's
        # OOM ledger, outliving victims' cgroups and pods' mounts: per cgroup the log's
        # kills, its counter's highest; recent kills with pod shm use; series as shown.
        self._oom_logged: Dict[str, int] = Counter()
        self._oom_own: Dict[str, int] = {}
        self._recent_oom: deque = deque(maxlen=50)
        self._oom_shown: Dict[str, OomCount] = {}
        self._oom_memo: tuple = (None, [])  # (what made the last counts, the counts)
        self._model, self._built_for = None, None  # and the version() it was built for
        self._accepted = 0  # observations accepted

    def version(self) -> Tuple[int, int]:
        return self._accepted, self.state.version()

    def accept(self, obs: Observation) -> None:
        """Scheduler subscriber: keep the observation, compute what depends on it alone."""
        ok, summaries = obs.success, {}
        if ok and obs.source == "segments":
            # A quick run hands back the same object for a mount it did not touch: its
            # summary is kept, as is one made equal to the last (a render compares identity).
            before = self._result("segments")
            old = {m.mount: m for m in before.mounts} if before else {}
            for m in obs.result.mounts:
                if m.error:
                    continue
                kept = self._summaries.get(m.mount)
                if old.get(m.mount) is not m or not kept:
                    made = summarise(m, self.top_k, now=obs.result.wall_time)
                    kept = kept if made == kept else made
                summaries[m.mount] = kept
        elif ok and obs.source == "shm_mount":
            last = None if obs.full else self._result("shm_mount")
            kept = {id(u) for u in last or ()}  # unmeasured: handed back by a quick run
            self.state.record_polled(u for u in obs.result if id(u) not in kept)
        elif ok and obs.source == "oom":
            for kill in obs.result.new:
                self._count_kill(kill)
        with self._lock:
            if ok and obs.source == "cgroup":
                own = self._oom_own  # each counter kept as its highest: never down
                for c in obs.result:
                    if c.oom_kills is not None:
                        own[c.cgroup] = max(c.oom_kills, own.get(c.cgroup, 0))
                    for child, count in c.child_oom_kills:
                        if count:  # 0 adds nothing; 10,000s of them cost every build
                            own[child] = max(count, own.get(child, 0))
            if obs.source in self._latest:
                self._latest[obs.source] = obs
            if obs.source == "segments":
                self._summaries = summaries
            self._accepted += 1

    def _count_kill(self, kill: OomKill) -> None:
        """Count one kill under its pod's cgroup (node mode) or its own; log it with the pod's
        shm use then: a large shmem-rss or a full shm beside it is shm filling the limit."""
        key = kill.pod_cgroup if self.node_mode and kill.pod_cgroup else kill.task_memcg
        usages = [u for u in self._result("shm_mount") or [] if not u.error]
        if self.node_mode:
            uid = kill.pod_uid
            usages = [u for u in usages if uid and pod_uid_of_mount(u.mount) == uid]
        shm_used = sum(u.used_bytes for u in usages) if usages else None
        sizes = (kill.anon_rss_bytes, kill.shmem_rss_bytes, shm_used)
        mib = ["unknown" if n is None else f"{n / 2**20:.1f}MiB" for n in sizes]
        cgroups = kill.task_memcg or "?", kill.oom_memcg or "the whole host"
        pod = f" (pod {kill.pod_uid})" if kill.pod_uid else ""
        log.warning(OOM_LOG, kill.pid, kill.comm, *cgroups, *mib, pod)
        with self._lock:  # after the log line: a scrape that counts it finds it logged
            self._oom_logged[key] += 1
            self._recent_oom.append((kill, shm_used))

    def current(self) -> Model:
        with self._lock:
            version = self.version()  # before building: a change meanwhile builds again
            if version != self._built_for:
                self._model, self._built_for = self._build(), version
            return self._model

    def kill_log_complete(self) -> bool:
        """The kernel log is read and its last read lost nothing: it counts every OOM kill."""
        reports = self._result("oom")
        return reports is not None and reports.lost == 0

    def _result(self, name: str):
        obs = self._latest.get(name)
        return obs.result if obs and obs.success else None

    def _build(self) -> Model:
        statuses = [
            SourceStatus(n, o.success, o.duration, o.error) if o else SourceStatus(n)
            for n, o in self._latest.items()
        ]
        states = self.state.snapshot()
        usages = {u.mount: u for u in self._result("shm_mount") or []}
        inventory: Optional[Inventory] = self._result("segments")
        inv_mounts = {m.mount: m for m in inventory.mounts} if inventory else {}
        cgroups: List[CgroupMemory] = self._result("cgroup") or []
        unread = "cgroup" in self._latest and self._result("cgroup") is None
        limit_unknown = unread and self.memory_limit is None
        mounts, limits = [], (self.shm_size_limit, self.memory_limit)
        charged_to = cgroups_by_pod(cgroups)
        for target in self.discovery.current().targets:
            mount, usage = target.mount, usages.get(target.mount)
            # Outside node mode the watched cgroup's: a pod's volume (host mode) too.
            uid = pod_uid_of_mount(mount) if self.node_mode else ""
            cgroup = charged_to.get(uid)
            budget = peak = max_used = max_used_at = None
            if usage is not None and not usage.error:
                used = usage.used_bytes
                budget = shm_budget(usage, cgroup, *limits)
                peak = max(states.peaks.get(mount, used), used)
                max_used, max_used_at = states.max_used.get(mount, (used, time.time()))
            # Unknown, not none: an estimate's without a limit, a pod's cgroup unread.
            unknown = cgroup.estimated and not cgroup.limit_bytes if cgroup else uid
            mounts.append(
                MountView(
                    mount,
                    target.labels,
                    usage,
                    peak,
                    max_used,
                    max_used_at,
                    inv_mounts.get(mount),
                    self._summaries.get(mount),
                    cgroup,
                    budget,
                    not limit_unknown and not unknown,
                )
            )
        return Model(
            self.node_mode,
            statuses,
            mounts,
            inventory,
            cgroups,
            self._result("host_memory"),
            self._result("sysv") or [],
            self._result("gpu"),
            self._result("process") or [],
            states,
            self._oom_counts(cgroups, mounts),
            list(self._recent_oom),
        )

    def _oom_counts(self, cgroups, mounts: List[MountView]) -> List[OomCount]:
        """Per cgroup: the kernel log's kills in its subtree, or its counters' if higher (a kill
        before we started, or unlogged). v1 counts a kill in the victim's memcg only: the pod's
        counter plus each container's highest, kept after it is gone; v2's is hierarchical.
        Node mode: also each pod with a kill whose cgroup is gone (or never seen)."""
        logged, own = self._oom_logged, self._oom_own
        live = {c.pod_uid for c in cgroups}  # pods still there: by cgroup or by mount
        live |= {v.labels.get("pod_uid", "") for v in mounts}
        # Kills only ever add up: the same cgroups, pods and sums make the same counts.
        key = (cgroups, live, sum(logged.values()), sum(own.values()))
        if self._oom_memo[0] == key:
            return self._oom_memo[1]
        logged_below, own_below = _subtree_totals(logged), _subtree_totals(own)
        counts: Dict[str, OomCount] = {}
        for c in cgroups:  # (neither source counting kills: no series, not a false 0)
            if c.cgroup in own or "oom" in self._latest:
                at = c.cgroup.rstrip("/") or "/"
                kills = max(logged_below.get(at, 0), own_below.get(at, 0))
                counts[c.cgroup] = OomCount(c.cgroup, c.pod_uid, kills)
        for gone, n in sorted(logged.items()) if self.node_mode else ():
            if gone not in counts and (uid := pod_uid_in_cgroup(gone)):
                counts[gone] = OomCount(gone, uid, max(n, own.get(gone, 0)))
        # A counter never goes down, nor disappears while its pod is there (its cgroup read
        # failed once; discovery still sees the pod's mounts): PodOomKilled would fire on it.
        for cgroup, shown in self._oom_shown.items():
            if cgroup in counts and shown.kills > counts[cgroup].kills:
                counts[cgroup] = shown
            elif cgroup not in counts and (shown.pod_uid in live or not self.node_mode):
                counts[cgroup] = shown
        self._oom_shown = counts
        self._oom_memo = (key, list(counts.values()))
        return self._oom_memo[1]


def _lineage(cgroup: str) -> List[str]:
    path, lineage = cgroup.rstrip("/"), []
    while path:
        lineage.append(path)
        path = path.rsplit("/", 1)[0]
    return lineage + ["/"]


def _subtree_totals(counts: Dict[str, int]) -> Dict[str, int]:
    """cgroup -> its count plus those below it."""
    totals: Dict[str, int] = Counter()
    for key, n in counts.items():
        for path in _lineage(key):
            totals[path] += n
    return totals
