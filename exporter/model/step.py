"""Observations in, one Model out for /metrics and check: the model step.

`ModelStep.accept` is a scheduler subscriber: it runs on the thread that published the
observation (each source's own; the App's for a first run `Sampler.start` makes itself; the
watchdog's for a run past its timeout), keeps it, and
computes what depends on it alone (a mount's segment summary, the OOM ledger). `current`
runs on the caller's thread (an HTTP worker's scrape, `check`) and builds the Model when
anything moved since the last one. What both touch is under one lock. No I/O: what the
model knows came in an observation or from the state store."""

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Deque, Dict, FrozenSet, List, Mapping, Optional
from typing import Sequence, Set, Tuple

from exporter.host.kube import pod_uid_in_cgroup, pod_uid_of_mount
from exporter.model.state import HighWaterMark, MountStates, StateStore
from exporter.model.summary import SegmentSummary, ShmBudget, summarise
from exporter.model.summary import cgroups_by_pod, shm_budget
from exporter.model.types import CgroupMemory, GpuSnapshot, HostMemory, Inventory
from exporter.model.types import MountInventory, MountSet, MountUsage, Observation
from exporter.model.types import OomKill, OomReports, ProcessSample, SysvShm, Target

log = logging.getLogger(__name__)

OOM_LOG = "OOM kill: pid %d (%s) in %s (limit of %s hit): anon-rss %s, shmem-rss %s; shm used %s%s"
RECENT_OOM_KILLS = 50
# Node mode: how long a deleted pod's logged OOM kills are still shown. Long enough for
# PodOomKilled's increase() over 10 minutes to see the kill, with room for a missed scrape
# or a Prometheus restart; not for good (a series per pod ever killed grows without bound).
OOM_GONE_RETENTION_SECONDS = 3600.0
# The ledger is looked over for deleted pods at a Model build at least this far apart (so a
# pod's time gone is counted from a look up to this much after it went).
OOM_GONE_CHECK_SECONDS = 60.0


@dataclass(frozen=True)
class SourceStatus:
    """A source's last run as its shmwatch_collector_* series show it."""

    name: str
    success: bool = False  # the defaults: a source that has not answered yet
    duration: float = 0.0
    error: Optional[str] = None


@dataclass(frozen=True)
class MountView:
    """One mount discovery published, joined with every source's facts about it."""

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
    """A cgroup's OOM kills as shown (the ledger's, never down)."""

    cgroup: str
    pod_uid: str
    kills: int  # max(kernel log's kills below the cgroup, its counters'); never down


@dataclass(frozen=True)
class RecentOomKill:
    """A kill the kernel log reported, with its pod's shm use when it was read."""

    kill: OomKill
    shm_used_bytes: Optional[int]  # its pod's shm use when it was seen (None: unknown)


@dataclass(frozen=True)
class Model:
    """What /metrics and `check` read: built by `ModelStep.current` on the caller's thread,
    frozen, read by any thread (its lazy `shmem_unexplained` on the first reader's)."""

    node_mode: bool
    statuses: List[SourceStatus]  # in source order
    mounts: List[MountView]
    inventory: Optional[Inventory]  # process-level facts: comms, pods, unreadable, time
    cgroups: List[CgroupMemory]
    host_memory: Optional[HostMemory]
    sysv: List[SysvShm]  # one per IPC namespace (one in a sidecar); [] when not read
    gpu: Optional[GpuSnapshot]
    process_samples: List[ProcessSample]
    states: MountStates
    oom_kills: List[OomCount] = field(default_factory=list)
    # The newest OOM kills, oldest first.
    recent_oom_kills: List[RecentOomKill] = field(default_factory=list)

    def result_ok(self, source: str) -> bool:
        """The source's last run succeeded (the reader's thread)."""
        return any(s.name == source and s.success for s in self.statuses)

    @cached_property
    def shmem_unexplained(self) -> Dict[str, int]:
        """Per cgroup read: shmem less what its mounts, its IPC namespace's SysV RSS
        and memfds held from it or below explain. An estimate: a page is charged to its
        first toucher, a memfd held from two counts in both. {}: memfds unknown. Made on
        the first reader's thread (a render's, `check`'s), once per Model."""
        if self.inventory is None:
            return {}
        by_view = self._mounts_charged()
        by_sysv = self._sysv_resident()
        by_path = _memfd_below(self.inventory)
        out = {}
        for c in self.cgroups:
            if c.estimated or c.shmem_bytes is None:
                continue
            known = by_view.get(id(c), 0) + by_sysv.get(self._sysv_key(c.pod_uid), 0)
            known += by_path.get(c.cgroup.rstrip("/") or "/", 0)
            out[c.cgroup] = max(0, c.shmem_bytes - known)
        return out

    def _sysv_key(self, pod_uid: str) -> str:
        """(The reader's thread.) Whose SysV segments are charged to a cgroup: its pod's IPC
        namespace's (node mode), the one namespace's in a sidecar."""
        return pod_uid if self.node_mode else ""

    def _mounts_charged(self) -> Dict[int, int]:
        """(The reader's thread.) id(cgroup) -> the used bytes of the mounts charged to
        it."""
        charged: Dict[int, int] = Counter()
        for v in self.mounts:
            if v.cgroup is not None and v.usage is not None and not v.usage.error:
                charged[id(v.cgroup)] += v.usage.used_bytes
        return charged

    def _sysv_resident(self) -> Dict[str, int]:
        """(The reader's thread.) Whose SysV segments (`_sysv_key`) -> their resident bytes,
        from the IPC namespaces that could be read."""
        resident: Dict[str, int] = Counter()
        for s in self.sysv:
            if s.readable:
                resident[self._sysv_key(s.pod_uid)] += s.resident_bytes
        return resident


def _memfd_below(inventory: Inventory) -> Dict[str, int]:
    """(The Model's reader's thread.) cgroup path -> the bytes of the memfd regions held
    from it or below (a region once per cgroup: held from two below it, it counts once
    there)."""
    regions = [(seg.holders, seg.allocated_bytes) for seg in inventory.memfd]
    for pid, rest in inventory.memfd_rest.items():
        regions.append(((pid,), sum(t.allocated_bytes for t in rest.values())))
    below: Dict[str, int] = Counter()
    for holders, size in regions:
        held_in = {
            inventory.cgroup_of[pid] for pid in holders if pid in inventory.cgroup_of
        }
        for path in {p for c in held_in for p in _lineage(c)}:
            below[path] += size
    return below


@dataclass(frozen=True)
class _OomInputs:
    """What made the last OOM counts: kills only ever add up, so the same cgroups, pods and
    sums make the same counts (a deleted pod's leaving the ledger counts them again)."""

    cgroups: Tuple[CgroupMemory, ...]
    live_pods: FrozenSet[str]
    logged: int
    counted: int


@dataclass(frozen=True)
class _Joins:
    """What a build looks each mount up in."""

    states: MountStates
    usages: Dict[str, MountUsage]
    inventories: Dict[str, MountInventory]
    charged_to: Dict[str, CgroupMemory]  # by pod UID (cgroups_by_pod)
    # The cgroups were not read and no --memory.limit-bytes: every mount's limit unknown.
    limit_unknown: bool


@dataclass
class _Results:
    """The latest successful result of each source the model reads (None: off, failed, or
    not run yet)."""

    usages: Optional[List[MountUsage]] = None
    inventory: Optional[Inventory] = None
    cgroups: Optional[List[CgroupMemory]] = None
    host_memory: Optional[HostMemory] = None
    sysv: Optional[List[SysvShm]] = None
    gpu: Optional[GpuSnapshot] = None
    process: Optional[List[ProcessSample]] = None


class ModelStep:
    """Observations in (`accept`, on each publishing thread), the Model out (`current`, on
    the caller's thread). What both touch is under `_lock`. Outside it, `_summarise` and
    `_record_polled` read their own source's last result (a reference, replaced whole by
    that source's publications: its thread's, or the watchdog's failure, which the
    scheduler publishes one at a time); `_shm_used_by` (the oom source's thread) reads
    shm_mount's last list the same way."""

    def __init__(
        self,
        statuses: Sequence[str],
        state: StateStore,
        node_mode: bool = False,
        top_k: int = 10,
        shm_size_limit: Optional[int] = None,
        memory_limit: Optional[int] = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """On the App's thread. `statuses`: the sources with status series, in render
        order. `monotonic`: the clock deleted pods leave the OOM ledger by."""
        self.state, self.top_k = state, top_k
        self.node_mode, self.shm_size_limit = node_mode, shm_size_limit
        # --memory.limit-bytes is the one workload's limit: it means nothing per pod.
        self.memory_limit = None if self.node_mode else memory_limit
        self._lock = threading.Lock()
        # source -> its latest Observation or None, in render order
        self._latest: Dict[str, Optional[Observation]] = dict.fromkeys(statuses)
        self._results = _Results()
        self._targets: List[Target] = []  # discovery's last set
        self._summaries: Dict[str, SegmentSummary] = {}  # the latest inventory's
        # OOM ledger, outliving victims' cgroups and pods' mounts: per cgroup the log's
        # kills, its counter's highest; recent kills with pod shm use; series as shown.
        self._oom_logged: Dict[str, int] = Counter()
        self._oom_own: Dict[str, int] = {}
        self._recent_oom: Deque[RecentOomKill] = deque(maxlen=RECENT_OOM_KILLS)
        self._oom_shown: Dict[str, OomCount] = {}
        self._oom_made_of: Optional[_OomInputs] = None
        self._oom_counts: List[OomCount] = []
        # Node mode: each pod in the ledger found deleted, and when; its next look.
        self._monotonic = monotonic
        self._pods_gone_since: Dict[str, float] = {}
        self._next_gone_check = monotonic()
        self._model: Optional[Model] = None
        self._built_for: Optional[Tuple[int, int]] = (
            None  # the version() it was built for
        )
        self._accepted = 0  # observations accepted

    def version(self) -> Tuple[int, int]:
        """Any thread: (observations accepted, the state store's version); the Model is
        built again when it moved."""
        return self._accepted, self.state.version()

    # --- observations in: on the thread that published them -------------------------------

    def accept(self, obs: Observation) -> None:
        """Scheduler subscriber, on the thread that published `obs` (its source's; the App's
        for a first run `Sampler.start` makes; the watchdog's for a run past its timeout): keep the observation, compute what depends
        on it alone (a segments run's summaries, a poll's peaks, the OOM ledger)."""
        result = obs.result if obs.success else None
        summaries = None
        if obs.source == "segments":
            summaries = self._summarise(result)  # outside the lock: the slow part
        elif obs.source == "shm_mount" and isinstance(result, list):
            self._record_polled(result, obs.full)
        elif obs.source == "oom" and isinstance(result, OomReports):
            for kill in result.new:
                self._count_kill(kill)
        with self._lock:
            self._keep(obs.source, result)
            if obs.source in self._latest:
                self._latest[obs.source] = obs
            if summaries is not None:
                self._summaries = summaries
            self._accepted += 1
            # Built again at the next current(): the one before holds the observations
            # before (a storm's inventory), freed now rather than at the next scrape.
            self._model = None

    def _keep(self, source: str, result: object) -> None:
        """The publishing thread, under the lock: the result, typed, as the latest (None
        for a failed run)."""
        if source == "discovery":
            # A failed run (result None) leaves the last set standing.
            if isinstance(result, MountSet):
                self._targets = result.targets
        elif source == "cgroup":
            self._results.cgroups = result if isinstance(result, list) else None
            self._count_cgroup_kills(self._results.cgroups or [])
        elif source == "segments":
            self._results.inventory = result if isinstance(result, Inventory) else None
        elif source == "shm_mount":
            self._results.usages = result if isinstance(result, list) else None
        else:
            self._keep_plain(source, result)

    def _keep_plain(self, source: str, result: object) -> None:
        """The publishing thread, under the lock: `_keep` for the sources kept as they
        are."""
        if source == "host_memory":
            self._results.host_memory = (
                result if isinstance(result, HostMemory) else None
            )
        elif source == "sysv":
            self._results.sysv = result if isinstance(result, list) else None
        elif source == "gpu":
            self._results.gpu = result if isinstance(result, GpuSnapshot) else None
        elif source == "process":
            self._results.process = result if isinstance(result, list) else None

    def _summarise(self, result: object) -> Dict[str, SegmentSummary]:
        """The segments source's thread (or the watchdog's, for its failure), outside the
        lock: each mount's summary. A quick run hands back the same object for a mount it
        did not touch: its summary is kept, as is one made equal to the last (a render
        compares identity). {} when the run failed."""
        if not isinstance(result, Inventory):
            return {}
        before = self._results.inventory
        old = {m.mount: m for m in before.mounts} if before else {}
        summaries = {}
        for m in result.mounts:
            if m.error:
                continue
            kept = self._summaries.get(m.mount)
            if old.get(m.mount) is not m or not kept:
                made = summarise(m, self.top_k, now=result.wall_time)
                kept = kept if made == kept else made
            summaries[m.mount] = kept
        return summaries

    def _record_polled(self, usages: List[MountUsage], full: bool) -> None:
        """The shm_mount source's thread: peaks and high-water marks into the state store;
        a quick run hands back unmeasured mounts' usages, not recorded again."""
        last = None if full else self._results.usages
        kept = {id(u) for u in last or ()}
        self.state.record_polled(u for u in usages if id(u) not in kept)

    def _count_cgroup_kills(self, cgroups: List[CgroupMemory]) -> None:
        """The publishing thread (the cgroup source's; the watchdog's, with nothing, for a run
        past its timeout), under the lock: each counter kept as its highest, never down."""
        own = self._oom_own
        for c in cgroups:
            if c.oom_kills is not None:
                own[c.cgroup] = max(c.oom_kills, own.get(c.cgroup, 0))
            for child, count in c.child_oom_kills:
                if count:  # 0 adds nothing; 10,000s of them cost every build
                    own[child] = max(count, own.get(child, 0))

    def _count_kill(self, kill: OomKill) -> None:
        """The oom source's thread: count one kill under its pod's cgroup (node mode) or its
        own; log it with the pod's shm use then: a large shmem-rss or a full shm beside it
        is shm filling the limit."""
        # Node mode counts pods' kills only: another cgroup's (a systemd scope) would never
        # be shown, nor ever leave the ledger.
        key = kill.pod_cgroup if self.node_mode else kill.task_memcg
        shm_used = self._shm_used_by(kill)
        sizes = (kill.anon_rss_bytes, kill.shmem_rss_bytes, shm_used)
        mib = ["unknown" if n is None else f"{n / 2**20:.1f}MiB" for n in sizes]
        cgroups = kill.task_memcg or "?", kill.oom_memcg or "the whole host"
        pod = f" (pod {kill.pod_uid})" if kill.pod_uid else ""
        log.warning(OOM_LOG, kill.pid, kill.comm, *cgroups, *mib, pod)
        with self._lock:  # after the log line: a scrape that counts it finds it logged
            if key:
                self._oom_logged[key] += 1
            self._recent_oom.append(RecentOomKill(kill=kill, shm_used_bytes=shm_used))

    def _shm_used_by(self, kill: OomKill) -> Optional[int]:
        """The oom source's thread: the shm the victim's pod used (node mode), or the
        watched mounts' (a sidecar), as the last poll measured it."""
        usages = [u for u in self._results.usages or [] if not u.error]
        if self.node_mode:
            uid = kill.pod_uid
            usages = [u for u in usages if uid and pod_uid_of_mount(u.mount) == uid]
        return sum(u.used_bytes for u in usages) if usages else None

    # --- the model out: on the caller's thread ---------------------------------------------

    def current(self) -> Model:
        """The caller's thread (an HTTP worker's scrape, `check`): the Model, built again
        under the lock when anything moved since the last one."""
        with self._lock:
            version = self.version()  # before building: a change meanwhile builds again
            if self._model is None or version != self._built_for:
                self._model, self._built_for = self._build(), version
            return self._model

    def _build(self) -> Model:
        """The caller's thread, under the lock: the Model from every source's latest result
        and a snapshot of the state store."""
        statuses = [
            SourceStatus(n, o.success, o.duration, o.error) if o else SourceStatus(n)
            for n, o in self._latest.items()
        ]
        cgroups = self._results.cgroups or []
        inventory = self._results.inventory
        joins = _Joins(
            states=self.state.snapshot(),
            usages={u.mount: u for u in self._results.usages or []},
            inventories={m.mount: m for m in inventory.mounts} if inventory else {},
            charged_to=cgroups_by_pod(cgroups),
            limit_unknown=self._limits_unread(),
        )
        mounts = [self._mount_view(t, joins) for t in self._targets]
        return Model(
            node_mode=self.node_mode,
            statuses=statuses,
            mounts=mounts,
            inventory=inventory,
            cgroups=cgroups,
            host_memory=self._results.host_memory,
            sysv=self._results.sysv or [],
            gpu=self._results.gpu,
            process_samples=self._results.process or [],
            states=joins.states,
            oom_kills=self._oom_counts_for(cgroups, mounts),
            recent_oom_kills=list(self._recent_oom),
        )

    def _mount_view(self, target: Target, joins: "_Joins") -> MountView:
        """The caller's thread, under the lock: one mount joined with its usage, peaks,
        inventory, summary, cgroup and shm budget."""
        mount = target.mount
        usage = joins.usages.get(mount)
        # Outside node mode the watched cgroup's: a pod's volume (host mode) too.
        uid = pod_uid_of_mount(mount) if self.node_mode else ""
        cgroup = joins.charged_to.get(uid)
        budget = peak = high = None
        if usage is not None and not usage.error:
            used = usage.used_bytes
            budget = shm_budget(usage, cgroup, self.shm_size_limit, self.memory_limit)
            peak = max(joins.states.peaks.get(mount, used), used)
            # None: no poll of it recorded yet; its use now is the highest (made only then:
            # a build makes a view per mount, 2,000 on a node).
            high = joins.states.max_used.get(mount)
            high = high or HighWaterMark(used_bytes=used, at=time.time())
        return MountView(
            mount=mount,
            labels=target.labels,
            usage=usage,
            peak_bytes=peak,
            max_used_bytes=high.used_bytes if high else None,
            max_used_at=high.at if high else None,
            inventory=joins.inventories.get(mount),
            summary=self._summaries.get(mount),
            cgroup=cgroup,
            budget=budget,
            budget_complete=not (joins.limit_unknown or _limit_unknown(cgroup, uid)),
        )

    def _limits_unread(self) -> bool:
        """(The caller's thread.) The memory limit is unknown, not none, for every mount:
        the cgroups were not read and no --memory.limit-bytes was given."""
        unread = "cgroup" in self._latest and self._results.cgroups is None
        return unread and self.memory_limit is None

    def _oom_counts_for(
        self, cgroups: List[CgroupMemory], mounts: List[MountView]
    ) -> List[OomCount]:
        """The caller's thread, under the lock; counted again only when its inputs moved.
        Per cgroup: the kernel log's kills in its subtree, or its counters' if higher (a
        kill before we started, or unlogged). v1 counts a kill in the victim's memcg only:
        the pod's counter plus each container's highest, kept after it is gone; v2's is
        hierarchical. Node mode: also each pod with a kill whose cgroup is gone (or never
        seen)."""
        live = {c.pod_uid for c in cgroups}  # pods still there: by cgroup or by mount
        live |= {v.labels.get("pod_uid", "") for v in mounts}
        # A cgroup run that failed, or found no pod at all, says nothing of who is gone.
        if self.node_mode and self._results.cgroups:
            self._forget_deleted_pods(live)
        made_of = _OomInputs(
            cgroups=tuple(cgroups),
            live_pods=frozenset(live),
            logged=sum(self._oom_logged.values()),
            counted=sum(self._oom_own.values()),
        )
        if made_of != self._oom_made_of:
            counts = self._counted(cgroups)
            self._oom_shown = self._never_down(counts, live)
            self._oom_made_of = made_of
            self._oom_counts = list(self._oom_shown.values())
        return self._oom_counts

    def _forget_deleted_pods(self, live: Set[str]) -> None:
        """(The caller's thread, under the lock; node mode, after a cgroup run that read
        pods.) A pod neither read nor mounted for OOM_GONE_RETENTION_SECONDS leaves the
        ledger: its log's kills and its counters'. (A pod the cgroup run listed but could
        not read for want of fds or memory failed the run: it is not taken for gone.)"""
        now = self._monotonic()
        if now < self._next_gone_check:
            return
        self._next_gone_check = now + OOM_GONE_CHECK_SECONDS
        cgroups_of_gone: Dict[str, List[str]] = {}
        for cgroup in [*self._oom_logged, *self._oom_own]:
            uid = pod_uid_in_cgroup(cgroup)
            if uid and uid not in live:
                cgroups_of_gone.setdefault(uid, []).append(cgroup)
        # Only pods gone now keep their time gone (from the look that first missed them).
        since = {uid: self._pods_gone_since.get(uid, now) for uid in cgroups_of_gone}
        for uid, cgroups in cgroups_of_gone.items():
            if now - since[uid] >= OOM_GONE_RETENTION_SECONDS:
                del since[uid]
                for cgroup in cgroups:
                    self._oom_logged.pop(cgroup, None)
                    self._oom_own.pop(cgroup, None)
                self._oom_made_of = None  # the sums went down: counted again
        self._pods_gone_since = since

    def _counted(self, cgroups: List[CgroupMemory]) -> Dict[str, OomCount]:
        """(The caller's thread, under the lock.) Each cgroup read: the larger of the log's
        kills and its counters' in its subtree; node mode, also each pod's cgroup with a
        logged kill that was not read (gone, or never seen)."""
        logged, own = self._oom_logged, self._oom_own
        logged_below, own_below = _subtree_totals(logged), _subtree_totals(own)
        counts: Dict[str, OomCount] = {}
        for c in cgroups:  # (neither source counting kills: no series, not a false 0)
            if c.cgroup in own or "oom" in self._latest:
                at = c.cgroup.rstrip("/") or "/"
                kills = max(logged_below.get(at, 0), own_below.get(at, 0))
                counts[c.cgroup] = OomCount(
                    cgroup=c.cgroup, pod_uid=c.pod_uid, kills=kills
                )
        for gone, n in sorted(logged.items()) if self.node_mode else ():
            if gone not in counts and (uid := pod_uid_in_cgroup(gone)):
                kills = max(n, own.get(gone, 0))
                counts[gone] = OomCount(cgroup=gone, pod_uid=uid, kills=kills)
        return counts

    def _never_down(
        self, counts: Dict[str, OomCount], live: Set[str]
    ) -> Dict[str, OomCount]:
        """(The caller's thread, under the lock.) A counter never goes down, nor disappears
        while its pod is there (its cgroup read failed once; discovery still sees the pod's
        mounts): PodOomKilled would fire on it."""
        for cgroup, shown in self._oom_shown.items():
            if cgroup in counts and shown.kills > counts[cgroup].kills:
                counts[cgroup] = shown
            elif cgroup not in counts and (shown.pod_uid in live or not self.node_mode):
                counts[cgroup] = shown
        return counts


def _limit_unknown(cgroup: Optional[CgroupMemory], uid: str) -> bool:
    """(The caller's thread.) A mount's memory limit is unknown, not none: its cgroup an
    estimate without a limit; a pod's cgroup unread (`uid`: the mount's pod)."""
    if cgroup is not None:
        return cgroup.estimated and not cgroup.limit_bytes
    return bool(uid)


def _lineage(cgroup: str) -> List[str]:
    """The cgroup and each above it, up to "/" (any thread)."""
    path, lineage = cgroup.rstrip("/"), []
    while path:
        lineage.append(path)
        path = path.rsplit("/", 1)[0]
    return lineage + ["/"]


def _subtree_totals(counts: Mapping[str, int]) -> Dict[str, int]:
    """cgroup -> its count plus those below it (any thread)."""
    totals: Dict[str, int] = Counter()
    for key, n in counts.items():
        for path in _lineage(key):
            totals[path] += n
    return totals
