"""The model as the catalogue's families, those exposed (catalogue.MetricSelection).
A mount's or cgroup's series (most as in the last render) are reused while their inputs are
equal (Families.parts_of). A bug in one source's renderer drops that source's series and
marks it failed, not the scrape.

Labels say what a series is about once: in node mode a pod's mount by its pod and volume
(or a runtime's by its container), not also by its path; a pod's cgroup by its pod; a
process by its name (comm), summed or its largest, never by its pid."""

import functools
import logging
import re
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

from prometheus_client.registry import Collector

from exporter import __version__
from exporter.exposition.render import Families, Family, Memo, Row
from exporter.model.step import Model, ModelStep, MountView
from exporter.model.summary import (
    SegmentSummary,
    ShmBudget,
    memfd_summary,
    named_on_exporter,
    owner_comm,
)
from exporter.model.types import (
    CgroupMemory,
    Inventory,
    MountInventory,
    MountUsage,
    Segment,
)

log = logging.getLogger(__name__)
MAX_LABEL_CHARS = 128
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean_label(value: "str | bytes", limit: int = MAX_LABEL_CHARS) -> str:
    """A label from a file or process name, any bytes of any length (shm_open()'s
    argument): not UTF-8 as U+FFFD, control chars as \\xNN (a raw CR or escape breaks
    dashboards and terminals), capped so one hostile name cannot bloat every scrape."""
    if isinstance(value, str):
        # os.scandir() hands undecodable bytes back as lone surrogates.
        value = value.encode("utf-8", "surrogateescape")
    text = value.decode("utf-8", "replace")
    text = _CONTROL.sub(lambda m: "\\x%02x" % ord(m.group()), text)
    if len(text) > limit:
        text = text[: limit - 1] + "\u2026"
    return text


clean = functools.lru_cache(maxsize=1 << 14)(clean_label)  # names recur each render
# The sources ModelCollector renders, each by its method _<name>.
RENDERED = ("shm_mount", "segments", "sysv", "host_memory", "cgroup", "gpu", "process")
SEGMENT_SERIES = ("segments", "segment_bytes", "segment_apparent_bytes")
# A mount's series, shmwatch_mount_<name>, in the order they are added.
MOUNT_SERIES = (
    "size_bytes used_bytes available_bytes usage_ratio inodes inodes_free peak_used_bytes "
    "max_used_bytes max_used_timestamp_seconds"
).split()


def mount_label(view: MountView) -> str:
    """A mount's `mount` label: its path, or '' (left out) where node mode names it by its
    pod and volume or its container."""
    return "" if any(view.labels.values()) else view.mount


def cgroup_label(
    cgroup: str, pod_uid: str, node_mode: bool, ambiguous: FrozenSet[str] = frozenset()
) -> str:
    """A cgroup's `cgroup` label: its path, or '' (left out) for a pod's in node mode, whose
    pod_uid says which it is; unless the pod is `ambiguous` (two cgroups of it in one family:
    an OOM count kept under the path the kernel named, beside the pod's live cgroup), where
    the path tells the two series apart."""
    if node_mode and pod_uid and pod_uid not in ambiguous:
        return ""
    return clean(cgroup, 256)


def pods_twice(pod_uids: Iterable[str]) -> FrozenSet[str]:
    """The pods named more than once: their series keep the cgroup's path."""
    counted = Counter(uid for uid in pod_uids if uid)
    return frozenset(uid for uid, n in counted.items() if n > 1)


def largest_by_name(
    held: Iterable[Tuple[int, int]], comms: Dict[int, str], pods: Dict[int, str]
) -> Dict[Tuple[str, str], int]:
    """(pid, bytes) -> (comm, pod UID) -> the most any one of those processes holds."""
    out: Dict[Tuple[str, str], int] = {}
    for pid, size in held:
        key = clean(comms.get(pid, "unknown")), pods.get(pid, "")
        out[key] = max(size, out.get(key, 0))
    return out


@dataclass(frozen=True)
class ListedMount:
    """A mount whose inventory was read without an error: its segments' series."""

    view: MountView
    summary: SegmentSummary
    inventory: MountInventory


def listed_mounts(model: Model) -> List[ListedMount]:
    return [
        ListedMount(view=v, summary=v.summary, inventory=v.inventory)
        for v in model.mounts
        if v.summary is not None and v.inventory is not None
    ]


def required(inventory: Optional[Inventory]) -> Inventory:
    """The inventory a successful segments run made (a render of none fails, logged)."""
    if inventory is None:
        raise ValueError("the segments source succeeded without an inventory")
    return inventory


@dataclass(frozen=True)
class NamedSegment:
    """A segment the exporter names, with what its series says of it besides."""

    # Its mount's `mount` label (mount_label) and node mode's labels.
    mount: str
    labels: Dict[str, str]
    segment: Segment
    # The process name (comm) of its first holder.
    owner: str


class ModelCollector(Collector):
    """Renders the model step's current Model; reads nothing else. `exposed`: the families
    to render (None: every one)."""

    def __init__(self, step: ModelStep, exposed: Optional[FrozenSet[str]] = None):
        self.step, self.exposed = step, exposed
        self.parts = Memo()  # the last render's (Families.parts_of)
        self._lock = threading.Lock()  # one render at a time: they share parts

    def describe(self) -> List[Family]:  # registering must not trigger a collect
        return []

    def collect(self) -> Iterable[Family]:
        with self._lock:
            model = self.step.current()
            out = Families(model.node_mode, self.parts, exposed=self.exposed)
            out.add("shmwatch_build_info", [__version__], 1)
            for status in model.statuses:
                name, ok = status.name, status.success
                if ok and name in RENDERED:
                    ok = self._guarded(name, getattr(self, f"_{name}"), model, out)
                out.add("shmwatch_collector_success", [name], 1 if ok else 0)
                out.add("shmwatch_collector_duration_seconds", [name], status.duration)
            self._guarded("derived metrics", self._derived, model, out)
            self._guarded("OOM kills", self._oom_kills, model, out)
            self._events(model, out)
            self.parts = out.made
            return list(out)

    def _guarded(
        self,
        what: str,
        render: Callable[[Model, Families], None],
        model: Model,
        out: Families,
    ) -> bool:
        """`render`'s series, or none of them (logged) when it fails."""
        staged = Families(out.node_mode, out.last, made=out.made, exposed=out.exposed)
        try:
            render(model, staged)
        except Exception:
            log.exception("rendering %s failed", what)
            return False
        for name, lines in staged.parts.items():
            out.parts.setdefault(name, []).extend(lines)
        return True

    def _shm_mount(self, model: Model, out: Families) -> None:
        rows = (
            (("shm_mount", v.mount), v.labels, mount_label(v), v.usage, v.peak_bytes)
            + (v.max_used_bytes, v.max_used_at)
            for v in model.mounts
            if v.usage is not None
        )
        out.parts_of(self._one_mount_usage, rows)

    @staticmethod
    def _one_mount_usage(
        out: Families, mount: str, m: MountUsage, *figures: Optional[float]
    ) -> None:
        """A mount that cannot be measured says so (mount_error 1); one that can, its figures
        (where an error 0 would only repeat that they are there)."""
        noswap = "true" if m.noswap else "false"
        out.add("shmwatch_mount_info", [mount, m.fstype, clean(m.source), noswap], 1)
        if m.error:
            out.add("shmwatch_mount_error", [mount], 1)
            return
        own = (m.size_bytes, m.used_bytes, m.available_bytes, m.usage_ratio, m.inodes)
        for field, value in zip(MOUNT_SERIES, (*own, m.inodes_free, *figures)):
            if value is not None:  # a peak or high-water mark not known yet
                out.add(f"shmwatch_mount_{field}", [mount], value)

    def _segments(self, model: Model, out: Families) -> None:
        inv = required(model.inventory)
        if inv.proc_unreadable is not None:  # None: hidden processes exist, uncounted
            out.add("shmwatch_proc_unreadable", [], inv.proc_unreadable)
        listed = listed_mounts(model)
        # Rows made again only for another inventory or summary (most renders have none).
        same = (
            inv,
            *[x for m in listed for x in (m.view.labels, m.summary, m.inventory)],
        )
        rows = (self._segments_row(m, inv) for m in listed)
        out.parts_of(self._one_mount_segments, rows, same)
        if out.wants("shmwatch_top_segment_bytes"):
            # One row, made only when parts_of finds `same` moved.
            named = (self._named_row(listed, inv.comms) for _ in range(1))
            out.parts_of(self._named_segments, named, same)
        states = (self._state_row(m, inv) for m in listed)
        out.parts_of(self._one_mount_state, states, same)
        memfds = memfd_summary(inv, self.step.top_k)
        for cls, totals in sorted(memfds.by_class.items()):
            out.add("shmwatch_memfd_regions", [cls], totals.count)
            out.add("shmwatch_memfd_bytes", [cls], totals.allocated_bytes)
        by_name = largest_by_name(memfds.top, inv.comms, inv.pods)
        for (comm, pod), size in by_name.items():
            pods = {"process_pod_uid": pod}
            out.add("shmwatch_process_memfd_bytes", [comm], size, pods)

    @staticmethod
    def _segments_row(m: ListedMount, inv: Inventory) -> Row:
        """With the comm and the pod of each process its series name."""
        pids = m.summary.named_pids
        comms = {pid: inv.comms.get(pid, "unknown") for pid in pids}
        pods = {pid: inv.pods.get(pid, "") for pid in pids}
        key = ("segments", m.view.mount)
        return key, m.view.labels, mount_label(m.view), m.summary, comms, pods

    @staticmethod
    def _state_row(m: ListedMount, inv: Inventory) -> Row:
        # An orphan's age moves on with every inventory (whole seconds: leaks are hours old).
        oldest, degraded = m.summary.oldest_orphan_mtime, int(m.summary.degraded)
        age = 0.0 if oldest is None else float(max(0, int(inv.wall_time - oldest)))
        verified = int(inv.owners_complete and not degraded)
        others = sorted(m.inventory.other_entries.items())
        key, unattributed = ("state", m.view.mount), m.inventory.unattributed_bytes
        return (
            key,
            m.view.labels,
            mount_label(m.view),
            age,
            degraded,
            verified,
            unattributed,
            others,
        )

    def _named_row(self, listed: List[ListedMount], comms: Dict[int, str]) -> Row:
        """The one row of the exporter's named segments: --segments.top-k of every mount's."""
        summaries = [(m.view, m.summary) for m in listed]
        named = [
            NamedSegment(
                mount=mount_label(v),
                labels=v.labels,
                segment=seg,
                owner=owner_comm(seg.holders, comms),
            )
            for v, seg in named_on_exporter(summaries, self.step.top_k)
        ]
        return ("named segments",), {}, named

    @staticmethod
    def _named_segments(out: Families, named: List[NamedSegment]) -> None:
        # Two names that clean to the same text are told apart by their inode.
        seen: Set[Tuple[Tuple[str, ...], str, str]] = set()
        for n in named:
            seg, name = n.segment, clean(n.segment.name)
            where = (n.mount, *n.labels.values())
            if (where, name, seg.state) in seen:
                name = f"{name} (inode {seg.key[1]})"
            seen.add((where, name, seg.state))
            values = [n.mount, name, seg.cls, seg.state, clean(n.owner)]
            out.add("shmwatch_top_segment_bytes", values, seg.allocated_bytes, n.labels)

    @staticmethod
    def _one_mount_segments(
        out: Families,
        mount: str,
        summary: SegmentSummary,
        comms: Dict[int, str],
        pods: Dict[int, str],
    ) -> None:
        for (cls, state), t in sorted(summary.totals.items()):
            figures = t.count, t.allocated_bytes, t.apparent_bytes
            for kind, value in zip(SEGMENT_SERIES, figures):
                out.add(f"shmwatch_{kind}", [mount, cls, state], value)
        by_name = largest_by_name(summary.top_processes, comms, pods)
        for (comm, pod), size in by_name.items():
            out.add(
                "shmwatch_process_shm_bytes",
                [mount, comm],
                size,
                {"process_pod_uid": pod},
            )

    @staticmethod
    def _one_mount_state(
        out: Families,
        mount: str,
        age: float,
        degraded: int,
        verified: int,
        unattributed: int,
        others: List[Tuple[str, int]],
    ) -> None:
        if not degraded:  # past --inventory.max-segments no orphan's age is known
            out.add("shmwatch_orphan_oldest_age_seconds", [mount], age)
        out.add("shmwatch_mount_unattributed_bytes", [mount], unattributed)
        out.add("shmwatch_mount_owners_verified", [mount], verified)
        out.add("shmwatch_inventory_degraded", [mount], degraded)
        for kind, count in others:
            out.add("shmwatch_mount_other_entries", [mount, kind], count)

    def _sysv(self, model: Model, out: Families) -> None:
        for shm in model.sysv:
            # Node mode: which IPC namespace and whose; a namespace we could not enter says
            # so and nothing else (an empty list of segments would read as "all clear").
            ns = {"ipc_namespace": shm.namespace, "pod_uid": shm.pod_uid}
            ns["container_id"] = shm.container_id
            out.add("shmwatch_sysv_namespace_readable", [], int(shm.readable), ns)
            if not shm.readable:
                continue
            for name, value in (
                ("segments", len(shm.segments)),
                ("bytes", shm.total_bytes),
                ("resident_bytes", shm.resident_bytes),
                ("orphan_segments", shm.orphans),
                ("limit_shmmax_bytes", shm.shmmax_bytes),
                ("limit_shmall_bytes", shm.shmall_bytes),
                ("limit_shmmni", shm.shmmni),
            ):
                if value is not None:  # a limit the kernel did not tell
                    out.add(f"shmwatch_sysv_{name}", [], value, ns)

    def _process(self, model: Model, out: Families) -> None:
        for name, value in ((s.name, s.value) for s in model.process_samples):
            out.add(name, [], value)

    def _host_memory(self, model: Model, out: Families) -> None:
        for field in ("total_bytes", "available_bytes", "shmem_bytes"):
            value = getattr(model.host_memory, field)
            if value is not None:  # a meminfo line the kernel did not print
                out.add(f"shmwatch_host_memory_{field}", [], value)

    def _cgroup(self, model: Model, out: Families) -> None:
        unexplained = model.shmem_unexplained.get
        twice = pods_twice(c.pod_uid for c in model.cgroups)
        rows = (
            (("cgroup", c.cgroup), {"pod_uid": c.pod_uid})
            + (cgroup_label(c.cgroup, c.pod_uid, model.node_mode, twice),)
            + (c, unexplained(c.cgroup))
            for c in model.cgroups
        )
        out.parts_of(self._one_cgroup, rows)

    @staticmethod
    def _one_cgroup(
        out: Families, shown: str, cg: CgroupMemory, unexplained: Optional[int]
    ) -> None:
        label = [shown]
        for name, value in (
            ("cgroup_memory_usage_bytes", cg.usage_bytes),
            ("cgroup_memory_working_set_bytes", cg.working_set_bytes),
            ("cgroup_memory_estimated", int(cg.estimated)),
            ("oom_risk_ratio", cg.oom_risk_ratio),
            ("cgroup_memory_shmem_bytes", cg.shmem_bytes),
            ("cgroup_memory_high_bytes", cg.high_bytes),
            ("cgroup_memory_swap_bytes", cg.swap_bytes),
            ("cgroup_memory_swap_limit_bytes", cg.swap_limit_bytes),
        ):
            if value is not None:  # no limit, or no shmem figure (an estimate)
                out.add(f"shmwatch_{name}", label, value)
        if cg.limit_bytes is not None:
            limit = [*label, cg.limit_source]
            out.add("shmwatch_cgroup_memory_limit_bytes", limit, cg.limit_bytes)
        for event, count in cg.events:
            out.add("shmwatch_cgroup_memory_events_total", [*label, event], count)
        if unexplained is not None:
            name = "shmwatch_cgroup_memory_shmem_unexplained_bytes"
            out.add(name, label, unexplained)

    def _gpu(self, model: Model, out: Families) -> None:
        gpus = model.gpu
        # A successful run made a snapshot: a render of none fails, logged.
        if gpus is None:
            raise ValueError("the gpu source succeeded without a snapshot")
        pods = model.inventory.pods if model.inventory else {}
        for d in gpus.devices:
            ids = [d.gpu, clean(d.uuid)]
            info = [*ids, clean(d.name), clean(gpus.driver_version)]
            out.add("shmwatch_gpu_info", info, 1)
            for field in ("total", "used", "free", "reserved"):
                value = getattr(d, f"{field}_bytes")
                if value is not None:  # reserved: not every driver tells it
                    out.add(f"shmwatch_gpu_memory_{field}_bytes", ids, value)
            # GPU memory is no two processes': a name's is their sum.
            used: Dict[Tuple[str, str], int] = {}
            for p in d.processes:
                key = clean(p.comm), pods.get(p.pid, "")
                used[key] = used.get(key, 0) + p.used_bytes
            for (comm, pod), size in used.items():
                labels, extra = ids + [comm], {"process_pod_uid": pod}
                out.add("shmwatch_gpu_process_memory_bytes", labels, size, extra)

    def _derived(self, model: Model, out: Families) -> None:
        """Effective shm size and the OOM projection: shm usage joined with the cgroup."""
        if not model.result_ok("shm_mount"):
            return
        rows = (
            (
                ("derived", v.mount),
                v.labels,
                mount_label(v),
                v.budget,
                v.budget_complete,
            )
            + (self._derived_cgroup(v.cgroup, model.node_mode),)
            for v in model.mounts
            if v.budget is not None
        )
        out.parts_of(self._one_derived, rows)

    @staticmethod
    def _derived_cgroup(cgroup: Optional[CgroupMemory], node_mode: bool) -> str:
        """The `cgroup` label of a mount's projection: '' (left out) without one."""
        if cgroup is None:
            return ""
        return cgroup_label(cgroup.cgroup, cgroup.pod_uid, node_mode)

    @staticmethod
    def _one_derived(
        out: Families, mount: str, budget: ShmBudget, complete: bool, cgroup: str
    ) -> None:
        if budget.projection is not None:
            labels = [mount, cgroup]
            out.add("shmwatch_shm_oom_projection_ratio", labels, budget.projection)
        if complete:
            size = budget.effective_bytes
            out.add("shmwatch_mount_effective_size_bytes", [mount], size)

    def _oom_kills(self, model: Model, out: Families) -> None:
        """From the model's counts, not the cgroup renderer: a pod's kills outlive its cgroup."""
        name, node_mode = "shmwatch_cgroup_oom_kills_total", model.node_mode
        twice = pods_twice(c.pod_uid for c in model.oom_kills)
        rows = (
            (("oom", c.cgroup), {"pod_uid": c.pod_uid}, name)
            + ([cgroup_label(c.cgroup, c.pod_uid, node_mode, twice)], c.kills)
            for c in model.oom_kills
        )
        out.parts_of(Families.add, rows, (model.oom_kills,))  # kept while unchanged

    def _events(self, model: Model, out: Families) -> None:
        states = model.states
        views = {v.mount: v for v in model.mounts}
        rows = (
            (("events", mount), views[mount].labels if mount in views else None)
            + (mount_label(views[mount]) if mount in views else mount,)
            + (states.event_rows.get(mount, ()), states.inotify.get(mount))
            + (states.overflows.get(mount, 0),)
            for mount in sorted({*states.event_rows, *states.inotify})
        )
        out.parts_of(self._mount_events, rows)

    @staticmethod
    def _mount_events(
        out: Families,
        mount: str,
        counts: Tuple[Tuple[str, str, int], ...],
        active: Optional[bool],
        overflows: int,
    ) -> None:
        for cls, event, count in counts:
            out.add("shmwatch_segment_events_total", [mount, cls, event], count)
        if active is not None:
            out.add("shmwatch_inotify_active", [mount], int(active))
        if active:
            out.add("shmwatch_inotify_overflows_total", [mount], overflows)
