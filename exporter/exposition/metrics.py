"""Turns the model into metric families, on a private registry.

Fresh families on every collect(), nothing kept between scrapes (client_python's
custom-collector pattern). Each source renders under its own guard, so a bug in one
renderer drops that source's series and marks it failed instead of failing the scrape.
Every family is built from the catalogue, so names, types and help cannot drift.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable, List, Optional

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter import __version__
from exporter.exposition.families import Families, FragmentCache, LineCache
from exporter.model.summary import owner_label
from exporter.model.types import CgroupMemory
from exporter.exposition.labels import clean
from exporter.model.step import Model, ModelStep

log = logging.getLogger(__name__)


class ModelCollector(Collector):
    """Renders the model step's current Model; reads nothing else."""

    def __init__(self, step: ModelStep):
        self.step = step
        self._cache = LineCache()
        self._fragments = FragmentCache()
        self._lock = threading.Lock()  # one render at a time: they share the line cache

    def describe(self) -> List[Metric]:
        return []  # no auto-describe: registering must not trigger a collect

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            self._cache.next_render()
            self._fragments.next_render()
            return self._collect()

    def _collect(self) -> List[Metric]:
        model = self.step.current()
        labels_by_mount = {v.mount: v.labels for v in model.mounts}
        out = Families(
            model.node_mode, lambda mount: labels_by_mount.get(mount, {}), self._cache
        )
        out.add("shmwatch_build_info", [__version__], 1)
        renderers = {
            "shm_mount": self._shm_mount,
            "segments": self._segments,
            "sysv": self._sysv,
            "host_memory": self._host_memory,
            "cgroup": self._cgroup,
            "gpu": self._gpu,
            "process": self._process,
        }
        for status in model.statuses:
            ok = status.success
            if ok and status.name in renderers:
                staged = out.child()
                try:
                    renderers[status.name](model, staged)
                except Exception:
                    log.exception("rendering %s failed", status.name)
                    ok = False
                else:
                    out.merge(staged)
            out.add("shmwatch_collector_success", [status.name], 1 if ok else 0)
            out.add(
                "shmwatch_collector_duration_seconds", [status.name], status.duration
            )
        try:
            self._derived(model, out)
        except Exception:
            log.exception("rendering derived metrics failed")
        try:
            self._oom_kills(model, out)
        except Exception:
            log.exception("rendering OOM kills failed")
        self._events(model, out)
        return list(out)

    # --- one renderer per source ---------------------------------------------------------
    def _shm_mount(self, model: Model, out: Families) -> None:
        out.fragments(
            self._fragments,
            (
                (
                    ("shm_mount", view.mount),
                    (),
                    (
                        view.usage,
                        view.peak_bytes,
                        view.max_used_bytes,
                        view.max_used_at,
                        view.labels,
                    ),
                    lambda staged, view=view: self._one_mount_usage(view, staged),
                )
                for view in model.mounts
                if view.usage is not None
            ),
        )

    @staticmethod
    def _one_mount_usage(view, out: Families) -> None:
        m = view.usage
        out.add("shmwatch_mount_info", [m.mount, m.fstype, clean(m.source)], 1)
        out.add("shmwatch_mount_error", [m.mount], 1 if m.error else 0)
        if m.error:
            return
        out.add("shmwatch_mount_size_bytes", [m.mount], m.size_bytes)
        out.add("shmwatch_mount_used_bytes", [m.mount], m.used_bytes)
        out.add("shmwatch_mount_available_bytes", [m.mount], m.available_bytes)
        out.add("shmwatch_mount_usage_ratio", [m.mount], m.usage_ratio)
        out.add("shmwatch_mount_inodes", [m.mount], m.inodes)
        out.add("shmwatch_mount_inodes_free", [m.mount], m.inodes_free)
        out.add("shmwatch_mount_peak_used_bytes", [m.mount], view.peak_bytes)
        out.add("shmwatch_mount_max_used_bytes", [m.mount], view.max_used_bytes)
        out.add(
            "shmwatch_mount_max_used_timestamp_seconds", [m.mount], view.max_used_at
        )

    def _segments(self, model: Model, out: Families) -> None:
        inv = model.inventory
        if inv.proc_unreadable is not None:  # None: hidden processes exist, uncounted
            out.add("shmwatch_proc_unreadable", [], inv.proc_unreadable)
        listed = [
            view
            for view in model.mounts
            if view.inventory is not None
            and not view.inventory.error
            and view.summary is not None
        ]
        # Keyed on the summary, not the inventory object (a full run makes every mount's
        # inventory anew): the model step keeps it while the mount's inventory is equal and
        # the processes its series name (summary.named_pids) kept their comm and pod.
        out.fragments(
            self._fragments,
            (
                (
                    ("segments", view.mount),
                    (view.summary,),
                    (view.labels,),
                    lambda staged, m=view.inventory, summary=view.summary: (
                        self._one_mount_segments(inv, m, summary, staged)
                    ),
                )
                for view in listed
            ),
        )
        # Not replayed: an orphan's age moves on with every inventory. In whole seconds (a
        # leak is hours old), so the renders of one second find their lines made: a node
        # whose mounts all hold an orphan made 200 lines anew in every event's render.
        for view in listed:
            oldest_orphan = view.summary.oldest_orphan_mtime
            age = (
                0.0
                if oldest_orphan is None
                else float(max(0, int(inv.wall_time - oldest_orphan)))
            )
            out.add("shmwatch_orphan_oldest_age_seconds", [view.mount], age)
        out.fragments(
            self._fragments,
            (
                (
                    ("entries", view.mount),
                    (),
                    (
                        view.labels,
                        inv.owners_complete,
                        view.inventory.unattributed_bytes,
                        tuple(sorted(view.inventory.other_entries.items())),
                    ),
                    lambda staged, m=view.inventory: self._one_mount_entries(
                        inv, m, staged
                    ),
                )
                for view in listed
            ),
        )

    @staticmethod
    def _one_mount_segments(inv, m, summary, out: Families) -> None:
        for (cls, state), (count, allocated, apparent) in sorted(
            summary.totals.items()
        ):
            out.add("shmwatch_segments", [m.mount, cls, state], count)
            out.add("shmwatch_segment_bytes", [m.mount, cls, state], allocated)
            out.add("shmwatch_segment_apparent_bytes", [m.mount, cls, state], apparent)
        seen_names = set()
        for seg in summary.top:
            label = clean(seg.name)
            if (label, seg.state) in seen_names:
                label = f"{label} (inode {seg.key[1]})"  # two names that clean to the same text
            seen_names.add((label, seg.state))
            out.add(
                "shmwatch_top_segment_bytes",
                [
                    m.mount,
                    label,
                    seg.cls,
                    seg.state,
                    clean(owner_label(seg.holders, inv.comms)),
                ],
                seg.allocated_bytes,
            )
        for pid, size in summary.top_processes:
            out.add(
                "shmwatch_process_shm_bytes",
                [m.mount, str(pid), clean(inv.comms.get(pid, "unknown"))],
                size,
                extra={"process_pod_uid": inv.pods.get(pid, "")},
            )

    @staticmethod
    def _one_mount_entries(inv, m, out: Families) -> None:
        out.add("shmwatch_mount_unattributed_bytes", [m.mount], m.unattributed_bytes)
        out.add(
            "shmwatch_mount_owners_verified", [m.mount], 1 if inv.owners_complete else 0
        )
        for kind, count in sorted(m.other_entries.items()):
            out.add("shmwatch_mount_other_entries", [m.mount, kind], count)

    def _sysv(self, model: Model, out: Families) -> None:
        for shm in model.sysv:
            # Node mode: which IPC namespace and whose; a namespace we could not enter says
            # so and nothing else (an empty list of segments would read as "all clear").
            ns = {
                "ipc_namespace": shm.namespace,
                "pod_uid": shm.pod_uid,
                "container_id": shm.container_id,
            }
            out.add(
                "shmwatch_sysv_namespace_readable",
                [],
                1 if shm.readable else 0,
                extra=ns,
            )
            if not shm.readable:
                continue
            out.add("shmwatch_sysv_segments", [], len(shm.segments), extra=ns)
            out.add("shmwatch_sysv_bytes", [], shm.total_bytes, extra=ns)
            out.add("shmwatch_sysv_resident_bytes", [], shm.resident_bytes, extra=ns)
            out.add("shmwatch_sysv_orphan_segments", [], shm.orphans, extra=ns)
            if shm.shmmax_bytes is not None:
                out.add(
                    "shmwatch_sysv_limit_shmmax_bytes", [], shm.shmmax_bytes, extra=ns
                )
            if shm.shmall_bytes is not None:
                out.add(
                    "shmwatch_sysv_limit_shmall_bytes", [], shm.shmall_bytes, extra=ns
                )
            if shm.shmmni is not None:
                out.add("shmwatch_sysv_limit_shmmni", [], shm.shmmni, extra=ns)

    def _process(self, model: Model, out: Families) -> None:
        for name, value in model.process_samples:
            out.add(name, [], value)

    def _host_memory(self, model: Model, out: Families) -> None:
        mem = model.host_memory
        out.add("shmwatch_host_memory_total_bytes", [], mem.total_bytes)
        out.add("shmwatch_host_memory_available_bytes", [], mem.available_bytes)
        out.add("shmwatch_host_memory_shmem_bytes", [], mem.shmem_bytes)

    def _cgroup(self, model: Model, out: Families) -> None:
        # By value: the series are made from the cgroup's figures alone (a node's 200
        # pods, of which a quiet one renders nothing anew).
        out.fragments(
            self._fragments,
            (
                (
                    ("cgroup", cg.cgroup),
                    (),
                    (cg,),
                    lambda staged, cg=cg: self._one_cgroup(cg, staged),
                )
                for cg in model.cgroups
            ),
        )

    def _one_cgroup(self, cg: CgroupMemory, out: Families) -> None:
        label = [clean(cg.cgroup, 256)]
        pod = {"pod_uid": cg.pod_uid}
        out.add("shmwatch_cgroup_memory_usage_bytes", label, cg.usage_bytes, extra=pod)
        out.add(
            "shmwatch_cgroup_memory_working_set_bytes",
            label,
            cg.working_set_bytes,
            extra=pod,
        )
        out.add(
            "shmwatch_cgroup_memory_estimated",
            label,
            1 if cg.estimated else 0,
            extra=pod,
        )
        if cg.limit_bytes is not None:
            out.add(
                "shmwatch_cgroup_memory_limit_bytes", label, cg.limit_bytes, extra=pod
            )
        if cg.oom_risk_ratio is not None:
            out.add("shmwatch_oom_risk_ratio", label, cg.oom_risk_ratio, extra=pod)
        if cg.shmem_bytes is not None:
            out.add(
                "shmwatch_cgroup_memory_shmem_bytes", label, cg.shmem_bytes, extra=pod
            )

    def _gpu(self, model: Model, out: Families) -> None:
        gpus = model.gpu
        for d in gpus.devices:
            ids = [d.gpu, clean(d.uuid)]
            out.add(
                "shmwatch_gpu_info",
                ids + [clean(d.name), clean(gpus.driver_version)],
                1,
            )
            out.add("shmwatch_gpu_memory_total_bytes", ids, d.total_bytes)
            out.add("shmwatch_gpu_memory_used_bytes", ids, d.used_bytes)
            out.add("shmwatch_gpu_memory_free_bytes", ids, d.free_bytes)
            if d.reserved_bytes is not None:
                out.add("shmwatch_gpu_memory_reserved_bytes", ids, d.reserved_bytes)
            for p in d.processes:
                out.add(
                    "shmwatch_gpu_process_memory_bytes",
                    ids + [str(p.pid), clean(p.comm)],
                    p.used_bytes,
                )

    # --- across sources --------------------------------------------------------------------
    def _derived(self, model: Model, out: Families) -> None:
        """Effective shm size and the OOM projection: shm usage joined with the cgroup."""
        if not model.result_ok("shm_mount"):
            return

        # Per mount, replayed while its budget is equal (a node's 200 mounts each render).
        def items():
            for view in model.mounts:
                budget = view.budget
                if budget is None:
                    continue
                cgroup = view.cgroup.cgroup if budget.projection is not None else None
                yield (
                    ("derived", view.mount),
                    (),
                    (budget, view.budget_complete, cgroup, view.labels),
                    lambda staged, view=view, cgroup=cgroup: self._one_mount_derived(
                        view, cgroup, staged
                    ),
                )

        out.fragments(self._fragments, items())

    @staticmethod
    def _one_mount_derived(view, cgroup: Optional[str], out: Families) -> None:
        if cgroup is not None:
            out.add(
                "shmwatch_shm_oom_projection_ratio",
                [view.mount, clean(cgroup, 256)],
                view.budget.projection,
            )
        if view.budget_complete:
            out.add(
                "shmwatch_mount_effective_size_bytes",
                [view.mount],
                view.budget.effective_bytes,
            )

    def _oom_kills(self, model: Model, out: Families) -> None:
        """From the model's counts, not the cgroup renderer: a pod's kills outlive its cgroup."""
        out.fragments(
            self._fragments,
            (
                (
                    ("oom_kills", count.cgroup),
                    (),
                    (count,),
                    lambda staged, count=count: staged.add(
                        "shmwatch_cgroup_oom_kills_total",
                        [clean(count.cgroup, 256)],
                        count.kills,
                        extra={"pod_uid": count.pod_uid},
                    ),
                )
                for count in model.oom_kills
            ),
        )

    def _events(self, model: Model, out: Families) -> None:
        """Per mount, replayed while its counts (then its inotify flag) are equal: a node's 200
        mounts' counters were a thousand samples made again on every render. Each family in
        the order of its mounts, as before."""
        states = model.states
        out.fragments(
            self._fragments,
            (
                (
                    ("events", mount),
                    (),
                    (counts, out.mount_labels(mount)),
                    lambda staged, mount=mount, counts=counts: self._one_mount_events(
                        mount, counts, staged
                    ),
                )
                for mount, counts in sorted(states.event_rows.items())
            ),
        )
        flags = [
            (mount, active, states.overflows.get(mount, 0) if active else None)
            for mount, active in sorted(states.inotify.items())
        ]
        out.fragments(
            self._fragments,
            (
                (
                    ("inotify", mount),
                    (),
                    (active, overflows, out.mount_labels(mount)),
                    lambda staged, mount=mount, active=active, overflows=overflows: (
                        self._one_mount_inotify(mount, active, overflows, staged)
                    ),
                )
                for mount, active, overflows in flags
            ),
        )

    @staticmethod
    def _one_mount_events(mount: str, counts: tuple, out: Families) -> None:
        for cls, event, count in counts:
            out.add("shmwatch_segment_events_total", [mount, cls, event], count)

    @staticmethod
    def _one_mount_inotify(
        mount: str, active: bool, overflows: Optional[int], out: Families
    ) -> None:
        out.add("shmwatch_inotify_active", [mount], 1 if active else 0)
        if active:
            out.add("shmwatch_inotify_overflows_total", [mount], overflows)
