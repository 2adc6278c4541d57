"""The model step: observations in, one joined picture out.

Each source's latest observation is kept here. When one arrives, what depends only on it
is computed at once, in the source's own thread (segment summaries: totals by class and
state, top K, leak candidates). The join — mounts with their usage, inventory, peak,
inotify flag, pod labels and the cgroup they are charged to, and the shm budget — is
rebuilt on first use after the version moved (an observation accepted, or the state store
changed). /metrics renders the Model and `shmwatch check` reports from it; neither
recomputes what is here.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from exporter.model.types import (
    CgroupMemory,
    GpuSnapshot,
    HostMemory,
    Inventory,
    MountInventory,
    MountUsage,
    Observation,
    OomKill,
    SysvShm,
)
from exporter.model.budget import ShmBudget, cgroups_by_pod, shm_budget


from exporter.model.summary import SegmentSummary, summarise
from exporter.host.kube import pod_uid_in_cgroup, pod_uid_of_mount

from exporter.model.state import MountStates, StateStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceStatus:
    name: str
    success: bool
    duration: float
    error: Optional[str]
    ran: bool  # False until the first observation (or timeout) arrived


@dataclass(frozen=True)
class MountView:
    mount: str
    labels: Dict[
        str, str
    ]  # node mode: pod_uid, volume, container_id; {} in sidecar mode
    usage: Optional[MountUsage]  # None when shm_mount is off, failed, or has not run
    peak_bytes: Optional[int]
    max_used_bytes: Optional[
        int
    ]  # high-water mark since the mount was first seen; None without usage
    max_used_at: Optional[float]  # wall clock when it was first reached
    inventory: Optional[
        MountInventory
    ]  # None when segments is off, failed, or has not run
    summary: Optional[SegmentSummary]
    cgroup: Optional[CgroupMemory]  # the memory cgroup its pages are charged to
    budget: Optional[ShmBudget]  # None without usage
    # False when the memory limit that bounds the budget is unknown: the cgroup collector is
    # on but failed, and no --memory.limit-bytes was given. The budget is then only the tmpfs
    # side, an upper bound: /metrics leaves the effective size out rather than overstate it.
    budget_complete: bool = True


@dataclass(frozen=True)
class OomCount:
    cgroup: str
    pod_uid: str
    kills: int  # max(kills in the kernel log under the cgroup, the cgroup's own counter): never down


@dataclass(frozen=True)
class Model:
    built_at: float  # wall clock
    node_mode: bool
    statuses: List[SourceStatus]  # in source order
    mounts: List[MountView]
    inventory: Optional[
        Inventory
    ]  # process-level facts: comms, pods, unreadable, wall time
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


@dataclass
class _Latest:
    obs: Optional[Observation] = None
    summaries: Dict[str, SegmentSummary] = field(default_factory=dict)  # segments only


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
        # Sources in the order their series are rendered; discovery's status only in node mode.
        self.source_names = [s.name for s in sources if s.reports_status]
        self.discovery = discovery
        self.state = state
        self.node_mode = discovery.node_mode
        self.top_k = top_k
        self.shm_size_limit = shm_size_limit
        # --memory.limit-bytes is the one workload's limit: it means nothing per pod.
        self.memory_limit = None if self.node_mode else memory_limit
        self._lock = threading.Lock()
        self._latest: Dict[str, _Latest] = {
            name: _Latest() for name in self.source_names
        }
        # The highest OOM count each cgroup series has shown (a counter never goes down: a
        # cgroup read that failed once, or a container's count gone with its cgroup, must not
        # make Prometheus see a reset and PodOomKilled fire on it).
        self._oom_floor: Dict[str, OomCount] = {}
        # The last counts and what they were made from: a node's model is built for every
        # event's render, and its 200 cgroups' kills change rarely (1 ms a build).
        self._oom_made: Optional[Tuple[object, tuple, List[OomCount]]] = None
        self._model: Optional[Model] = None
        self._accepted = 0  # observations accepted
        self._built_for: object = None  # the version() _model was built for

    def version(self) -> Tuple[int, int]:
        """Moves whenever the model would differ: an observation accepted, or the state changed."""
        return self._accepted, self.state.version()

    def accept(self, obs: Observation) -> None:
        """Sampler subscriber: keep the observation, compute what depends on it alone."""
        latest = _Latest(obs)
        if obs.success and obs.source == "segments":
            # A quick run hands back the same inventory object for a mount it did not touch:
            # its summary is the one already made (200 pods, one changed: one summary).
            before = self._latest.get("segments")
            made = {}
            renamed: Set[int] = set()
            if before is not None and before.obs is not None and before.obs.success:
                made = {
                    m.mount: (m, before.summaries.get(m.mount))
                    for m in before.obs.result.mounts
                }
                renamed = _renamed(before.obs.result, obs.result)
            latest.summaries = {}
            for m in obs.result.mounts:
                if m.error:
                    continue
                old, summary = made.get(m.mount, (None, None))
                # A full run makes every mount's inventory anew; one equal to the last (most of
                # a node's, most of the time) keeps its summary, and with it its rendered lines,
                # unless a process its series name changed its comm or pod (the render keys a
                # mount's lines on the summary alone).
                reuse = summary is not None and summary.named_pids.isdisjoint(renamed)
                if not (reuse and (old is m or old == m)):
                    made_now = summarise(m, self.top_k)
                    # An inventory that differs only where its summary does not (a refresh walks a
                    # directory in another order than quick runs patched it) keeps the summary too.
                    summary = summary if reuse and made_now == summary else made_now
                latest.summaries[m.mount] = summary
        if obs.success and obs.source == "shm_mount":
            self.state.record_used_many(
                [(u.mount, u.used_bytes) for u in obs.result if not u.error]
            )
        if obs.success and obs.source == "cgroup":
            for cgroup in obs.result:
                if cgroup.oom_kills is not None:
                    self.state.record_cgroup_oom(cgroup.cgroup, cgroup.oom_kills)
                for child, count in cgroup.child_oom_kills:
                    self.state.record_cgroup_oom(child, count)
        if obs.success and obs.source == "oom":
            for kill in obs.result.new:
                self._count_kill(kill)
        with self._lock:
            if obs.source in self._latest:
                self._latest[obs.source] = latest
            self._accepted += 1

    def _count_kill(self, kill: OomKill) -> None:
        """Count one kill under its pod's cgroup (node mode) or its own, and log it once with
        what was in the pod's shm then: a kill with a large shmem-rss, or a full shm beside
        it, is the shm filling the memory limit."""
        key = kill.pod_cgroup if self.node_mode and kill.pod_cgroup else kill.task_memcg
        with self._lock:
            usages = [u for u in self._result("shm_mount") or [] if not u.error]
        if self.node_mode:
            usages = [
                u
                for u in usages
                if kill.pod_uid and pod_uid_of_mount(u.mount) == kill.pod_uid
            ]
        shm_used = sum(u.used_bytes for u in usages) if usages else None
        mib = lambda n: "unknown" if n is None else f"{n / 2**20:.1f}MiB"
        log.warning(
            "OOM kill: pid %d (%s) in %s (limit of %s hit): anon-rss %s, shmem-rss %s; shm used %s%s",
            kill.pid,
            kill.comm,
            kill.task_memcg or "?",
            kill.oom_memcg or "the whole host",
            mib(kill.anon_rss_bytes),
            mib(kill.shmem_rss_bytes),
            mib(shm_used),
            f" (pod {kill.pod_uid})" if kill.pod_uid else "",
        )
        self.state.count_oom_kill(
            key, kill, shm_used
        )  # after the log line: a scrape that counts it finds it logged

    def current(self) -> Model:
        """The model, rebuilt first if anything changed since it was built."""
        with self._lock:
            version = self.version()
            if self._model is None or version != self._built_for:
                self._built_for = (
                    version  # before the build: a change during it moves it on
                )
                self._model = self._build()
            return self._model

    # --- the join -----------------------------------------------------------------------
    def _result(self, name: str):
        latest = self._latest.get(name)
        return (
            latest.obs.result if latest and latest.obs and latest.obs.success else None
        )

    def _build(self) -> Model:
        statuses = []
        for name in self.source_names:
            obs = self._latest[name].obs
            statuses.append(
                SourceStatus(
                    name,
                    bool(obs and obs.success),
                    obs.duration if obs else 0.0,
                    obs.error if obs else None,
                    obs is not None,
                )
            )
        states = self.state.snapshot()
        usages = {u.mount: u for u in self._result("shm_mount") or []}
        inventory: Optional[Inventory] = self._result("segments")
        inv_mounts = {m.mount: m for m in inventory.mounts} if inventory else {}
        summaries = (
            self._latest["segments"].summaries if "segments" in self._latest else {}
        )
        cgroups: List[CgroupMemory] = self._result("cgroup") or []
        limit_unknown = (
            "cgroup" in self._latest
            and self._result("cgroup") is None
            and self.memory_limit is None
        )
        mounts = []
        charged_to = cgroups_by_pod(cgroups)
        for target in self.discovery.current().targets:
            usage = usages.get(target.mount)
            cgroup = charged_to.get(pod_uid_of_mount(target.mount))
            budget = None
            if usage is not None and not usage.error:
                budget = shm_budget(
                    usage, cgroup, self.shm_size_limit, self.memory_limit
                )
            peak = max_used = max_used_at = None
            if usage is not None and not usage.error:
                peak = max(
                    states.peaks.get(target.mount, usage.used_bytes), usage.used_bytes
                )
                max_used, max_used_at = states.max_used.get(
                    target.mount, (usage.used_bytes, time.time())
                )
            mounts.append(
                MountView(
                    target.mount,
                    target.labels,
                    usage,
                    peak,
                    max_used,
                    max_used_at,
                    inv_mounts.get(target.mount),
                    summaries.get(target.mount),
                    cgroup,
                    budget,
                    not limit_unknown,
                )
            )
        return Model(
            time.time(),
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
            self._oom_counts(cgroups, states, mounts),
            list(states.recent_oom_kills),
        )

    def _oom_counts(
        self, cgroups: List[CgroupMemory], states: MountStates, mounts: List[MountView]
    ) -> List[OomCount]:
        """Per cgroup: the kills the kernel log showed in its subtree, or its own counter if
        higher (a kill before we started, or while the log could not be read). In node mode
        also every pod that had a kill and whose cgroup is gone (or was never seen)."""
        watching_log = "oom" in self._latest
        # A pod is there while its cgroup was read or discovery still sees its mounts: one
        # failed cgroup read does not end its series.
        live = {c.pod_uid for c in cgroups} | {
            v.labels.get("pod_uid", "") for v in mounts
        }
        inputs = (watching_log, states.oom_kills, states.oom_cgroup_max, live)
        made = self._oom_made
        if made is not None and made[0] is cgroups and made[1] == inputs:
            return made[2]  # the same again: _never_down's floor is what it returned
        counts: Dict[str, OomCount] = {}
        logged_below, max_below = (
            _Subtrees(states.oom_kills),
            _Subtrees(states.oom_cgroup_max),
        )
        for c in cgroups:
            prefix = c.cgroup.rstrip("/") + "/"
            # (the root cgroup "/" is its own prefix: counted once)
            logged = logged_below.total(prefix) + (
                0 if c.cgroup.startswith(prefix) else states.oom_kills.get(c.cgroup, 0)
            )
            own = states.oom_cgroup_max.get(c.cgroup)
            if own is None and not watching_log:
                continue  # neither source counts kills here: no series rather than a confident 0
            # v1 counts a kill in the victim's memcg only: the pod's own plus each container's
            # highest count ever seen (kept after the container's cgroup is gone). v2 records
            # no children: its pod counter is hierarchical already.
            below = max_below.total(prefix)
            counts[c.cgroup] = OomCount(
                c.cgroup, c.pod_uid, max(logged, (own or 0) + below)
            )
        if self.node_mode:
            for key, n in sorted(states.oom_kills.items()):
                pod = pod_uid_in_cgroup(key)
                if key not in counts and pod:
                    counts[key] = OomCount(
                        key, pod, max(n, states.oom_cgroup_max.get(key, 0))
                    )
        found = self._never_down(counts, live)
        self._oom_made = (cgroups, inputs, found)
        return found

    def _never_down(self, counts: Dict[str, OomCount], live_pods) -> List[OomCount]:
        """Each series at least as high as it ever was; a series whose cgroup was not read this
        time stays while its pod (or, outside node mode, the workload) is still there."""
        floor = self._oom_floor
        for key, count in counts.items():
            known = floor.get(key)
            if known is not None and known.kills > count.kills:
                counts[key] = known
            floor[key] = counts[key]
        for key, known in list(floor.items()):
            if key in counts:
                continue
            if known.pod_uid in live_pods or not self.node_mode:
                counts[key] = known
            else:
                del floor[key]  # the pod is gone: its series goes with it
        return list(counts.values())


def _renamed(before: Inventory, now: Inventory) -> Set[int]:
    """The pids whose comm or pod differs between two inventories (gone ones included): once
    per inventory, not once per mount and render (200 mounts' holders, 12,000 look-ups)."""
    renamed: Set[int] = set()
    for old, new in ((before.comms, now.comms), (before.pods, now.pods)):
        if old is new:
            continue
        # Set operations on the views, in C: a node's quick runs share most of these dicts' items.
        renamed.update(pid for pid, _ in new.items() - old.items())
        renamed.update(old.keys() - new.keys())
    return renamed


class _Subtrees:
    """Sums of counts below a cgroup path, by binary search over the sorted paths: 200 pods
    against every cgroup that ever had a kill, every model build, without a scan per pod."""

    def __init__(self, counts: Dict[str, int]):
        self._keys = sorted(counts)
        self._counts = counts

    def total(self, prefix: str) -> int:
        keys, at, found = self._keys, bisect.bisect_left(self._keys, prefix), 0
        while at < len(keys) and keys[at].startswith(prefix):
            found += self._counts[keys[at]]
            at += 1
        return found
