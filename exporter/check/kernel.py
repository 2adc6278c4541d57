"""`shmwatch check`'s findings beyond the mounts: recent OOM kills (the kernel's log), SysV shm
per IPC namespace, host and cgroup memory, and shared memory no watched mount shows (memfd,
unexplained shmem, NCCL >= 2.26.3's SHM transport in cuMem host memory: no nccl-* file)."""

import time
from dataclasses import asdict
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Tuple

from exporter.check import thresholds as T
from exporter.check.findings import MAX_NAMED, Bounded, Report, at_most, human
from exporter.check.names import shown
from exporter.host.paths import Paths, read_text
from exporter.host.proctable import ProcessTable
from exporter.model.step import Model
from exporter.model.summary import ShmBudget, memfd_summary
from exporter.model.types import CgroupMemory, HostMemory, Inventory, OomKill, SysvShm

OOM_FACTS: Tuple[str, ...] = ("pid", "comm", "task_memcg", "oom_memcg", "pod_uid")
OOM_FACTS += ("anon_rss_bytes", "shmem_rss_bytes", "file_rss_bytes")
SYSV_FACTS = ("pod_uid", "container_id", "readable")
SYSV_LIMITS = ("shmmax_bytes", "shmall_bytes", "shmmni")
PRIVILEGED = "deploy/kubernetes/daemonset-privileged, or run on the host as root"
# Prose, not a line to paste: the IDs are ipcs's, in the segments' IPC namespace.
IPCRM = "remove orphans (list them with ipcs -m, remove each with ipcrm -m ID)"
OOM_REMEDY = "count /dev/shm in the memory budget (shmem-rss and shm use are charged to the limit)"


def memory(report: Report, model: Model, cgroup_error: Optional[str]) -> None:
    """The host's memory, and every pod's cgroup (node mode: those at risk named) or this
    workload's, with its OOM kills and the projection of its mounts."""
    kills = {c.cgroup: c.kills for c in model.oom_kills}
    if model.node_mode:
        _pods(report, model.cgroups, kills)
    if model.host_memory is not None:
        _host(report, model.host_memory)
    if model.node_mode:
        return
    if not model.cgroups:
        if cgroup_error:
            report.add("info", "memory", "cgroup", f"not read: {shown(cgroup_error)}")
        return
    cgroup = model.cgroups[0]
    report.facts["cgroup"] = asdict(cgroup)
    _workload(report, cgroup, kills)
    _projections(report, model, cgroup)  # a projection is made against a limit only


def _pods(report: Report, pods: List[CgroupMemory], kills: Dict[str, int]) -> None:
    """Node mode: each pod near its limit, each pod's OOM kills, or that none is at risk."""
    report.facts["pod_cgroups"] = [asdict(c) for c in pods]
    risky = [c for c in pods if (c.oom_risk_ratio or 0) > T.OOM_RISK_RATIO]
    for c in pods:
        pod = shown(f"pod {c.pod_uid}")
        if c in risky:
            remedy = "raise the pod's memory limit or free its shm"
            report.add("warn", "memory", pod, _working_set(c), remedy)
        _kills(report, pod, kills.get(c.cgroup))
    if not risky:
        none = f"none above {T.OOM_RISK_RATIO:.0%} of its limit"
        report.add("ok", "memory", "pods", f"{len(pods)} pod cgroup(s), {none}")


def _host(report: Report, host: HostMemory) -> None:
    report.facts["host_memory"] = asdict(host)
    shmem = "unknown" if host.shmem_bytes is None else human(host.shmem_bytes)
    if host.available_bytes is None:  # no MemAvailable nor MemFree line: not judged
        text = f"{human(host.total_bytes)} total, available unknown (meminfo has no "
        text += f"MemAvailable or MemFree line), shmem {shmem}"
        report.add("info", "memory", "host", text)
        return
    ratio = host.available_bytes / host.total_bytes if host.total_bytes else 1
    low = ratio < T.HOST_MEMORY_AVAILABLE_LOW_RATIO
    text = f"{human(host.available_bytes)} of {human(host.total_bytes)} available"
    text += f" ({ratio:.0%}), shmem {shmem}"
    remedy = "free leaked shm, move workloads" if low else ""
    report.add("warn" if low else "ok", "memory", "host", text, remedy)


def _workload(report: Report, cgroup: CgroupMemory, kills: Dict[str, int]) -> None:
    """The workload's cgroup: its working set against its limit, and its OOM kills."""
    name, risk, text = shown(cgroup.cgroup), cgroup.oom_risk_ratio, _working_set(cgroup)
    if risk is None:
        text += ", no memory limit: OOM ratios not computed (pass --memory.limit-bytes)"
        report.add("info", "memory", name, text)
        return
    if cgroup.estimated:
        text += " (estimated: the workload's resident memory and shm; its cgroup is not readable here)"
    if cgroup.shmem_bytes is not None:
        text += f", shmem {human(cgroup.shmem_bytes)}"
    high = risk > T.OOM_RISK_RATIO
    remedy = "raise the memory limit or free shm" if high else ""
    report.add("warn" if high else "ok", "memory", name, text, remedy)
    _kills(report, name, kills.get(cgroup.cgroup, cgroup.oom_kills))


def _projections(report: Report, model: Model, cgroup: CgroupMemory) -> None:
    """Each mount charged to `cgroup` whose filling would OOM-kill the pod before ENOSPC."""
    for view in model.mounts:
        if view.cgroup is cgroup and view.budget is not None:
            _projection(report, view.mount, view.budget)


def _projection(report: Report, mount: str, budget: ShmBudget) -> None:
    # A projection is made against the cgroup's limit, which leaves the room it names.
    projection, room = budget.projection, budget.room_bytes
    if projection is None or room is None or projection <= T.SHM_OOM_PROJECTION_RATIO:
        return
    text = (
        f"filling it ({human(budget.fillable_bytes)}) would need {projection:.0%} "
        "of the memory limit: the pod is OOM-killed before tmpfs says ENOSPC"
    )
    remedy = f"lower sizeLimit to at most {at_most(room)} or raise the memory limit"
    report.add("warn", "memory", shown(mount), text, remedy)


def _working_set(c: CgroupMemory) -> str:
    text = f"working set {human(c.working_set_bytes)}"
    if c.limit_bytes:  # then oom_risk_ratio is working set / limit
        text += f" of {human(c.limit_bytes)} limit ({c.oom_risk_ratio:.0%})"
    return text


def _kills(report: Report, subject: str, kills: Optional[int]) -> None:
    if kills:
        remedy = "count /dev/shm in the memory budget"
        report.add("warn", "memory", subject, f"{kills} OOM kill(s) so far", remedy)


def oom_kills(report: Report, model: Model, error: Optional[str]) -> None:
    """The kernel log's recent OOM kills: victim, cgroups, its shmem RSS, the pod's shm use."""
    if error:
        error = shown(error)
        report.add("info", "memory", "OOM kills", f"kernel log not read: {error}")
    if error or not model.result_ok("oom"):
        return
    now_usec = time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6  # kmsg stamps this clock
    listed = []
    for kill, shm_used in ((r.kill, r.shm_used_bytes) for r in model.recent_oom_kills):
        age = max(0, int((now_usec - kill.boot_usec) / 1e6))
        facts = {name: getattr(kill, name) for name in OOM_FACTS}
        listed.append(dict(facts, age_seconds=age, pod_shm_used_bytes=shm_used))
        _oom_kill(report, kill, shm_used, age)
    report.facts["oom_kills"] = listed


def _oom_kill(report: Report, kill: OomKill, shm_used: Optional[int], age: int) -> None:
    """A kill: a warning while recent (PodOomKilled's window), then for information."""
    sizes = (kill.anon_rss_bytes, kill.shmem_rss_bytes)
    anon, rss = ("unknown" if n is None else human(n) for n in sizes)
    shm = "" if shm_used is None else f"; its pod's shm holds {human(shm_used)} now"
    text = (
        f"{shown(kill.comm)} in {shown(kill.task_memcg or '?')} killed {age} s ago (limit of "
        f"{shown(kill.oom_memcg or 'the host')}): anon-rss {anon}, shmem-rss {rss}{shm}"
    )
    severity = "warn" if age < T.OOM_KILL_RECENT_SECONDS else "info"
    report.add(severity, "memory", f"OOM kill pid {kill.pid}", text, OOM_REMEDY)


def sysv(report: Report, namespaces: Sequence[SysvShm], node_mode: bool) -> None:
    """SysV shm of each IPC namespace: near a kernel limit, orphans to remove, or not visible."""
    listed = [_sysv_namespace(report, ns, node_mode) for ns in namespaces]
    if node_mode:
        report.facts["sysv_namespaces"] = listed
    elif listed:
        report.facts["sysv"] = listed[0]


def _sysv_namespace(report: Report, ns: SysvShm, node_mode: bool) -> Dict[str, Any]:
    """One namespace's findings; -> its facts."""
    whose = shown(f"pod {ns.pod_uid}" if ns.pod_uid else ns.namespace)
    if ns.container_id and not ns.pod_uid:
        whose = shown(f"container {ns.container_id[:12]}")
    facts: Dict[str, Any] = {"ipc_namespace": ns.namespace}
    facts.update({name: getattr(ns, name) for name in SYSV_FACTS})
    if not ns.readable:
        text = f"SysV shm not visible ({shown(ns.error)}): entering an IPC namespace needs CAP_SYS_ADMIN"
        report.add("info", "sysv", whose, text, PRIVILEGED)
        return facts
    facts.update(segments=len(ns.segments), bytes=ns.total_bytes, orphans=ns.orphans)
    facts.update({name: getattr(ns, name) for name in SYSV_LIMITS})
    _sysv_use(report, ns, f"{whose}: " if node_mode else "", node_mode)
    return facts


def _sysv_use(report: Report, ns: SysvShm, whose: str, node_mode: bool) -> None:
    """A readable namespace near a kernel limit (shmmni, shmall), else its use and orphans
    (a node's namespaces without segments are not named)."""
    count, total = len(ns.segments), ns.total_bytes
    text = f"{whose}{count} segment(s), {human(total)}"
    near = T.SYSV_NEAR_LIMIT_RATIO
    if ns.shmmni and count > near * ns.shmmni:
        remedy = f"{IPCRM} or raise the limit: sysctl -w kernel.shmmni=8192"
        text += f": near the limit of {ns.shmmni}"
        report.add("warn", "sysv", "kernel.shmmni", text, remedy)
    elif ns.shmall_bytes and total > near * ns.shmall_bytes:
        remedy = f"{IPCRM} or raise the limit: sysctl kernel.shmall"
        text += f": near the limit of {human(ns.shmall_bytes)}"
        report.add("warn", "sysv", "kernel.shmall", text, remedy)
    elif ns.segments or not node_mode:
        if ns.orphans:
            text += f", {ns.orphans} with nothing attached and their creators gone"
        remedy = IPCRM if ns.orphans else ""
        report.add("ok", "sysv", "SysV shm", text, remedy)


def outside(report: Report, model: Model, paths: Paths, deadline: float) -> None:
    """Shared memory no watched mount shows: memfd regions, shmem their cgroups cannot
    explain, NCCL's SHM transport in cuMem host memory."""
    inv = model.inventory
    if inv is None:
        return
    _memfd(report, inv)
    _unexplained_shmem(report, model)
    segments = (s for v in model.mounts if v.inventory for s in v.inventory.rows())
    if not any(s.cls == "nccl" for s in segments):
        _nccl_in_cumem(report, paths, deadline)


def _memfd(report: Report, inv: Inventory) -> None:
    memfds = memfd_summary(inv, MAX_NAMED)
    by_class, top = memfds.by_class, memfds.top
    if by_class:
        count = sum(t.count for t in by_class.values())
        total = sum(t.allocated_bytes for t in by_class.values())
        holders = ", ".join(
            f"{shown(inv.comms.get(pid, 'unknown'))}[{pid}] {human(size)}"
            for pid, size in top
        )
        text = f"{count} memfd region(s), {human(total)}: shmem charged to the writer's"
        text += f" cgroup that no mount shows; held by {holders}"
        report.add("info", "memory", "memfd", text)


def _unexplained_shmem(report: Report, model: Model) -> None:
    """A cgroup's shmem that no watched mount, SysV segment or memfd explains, from 64 MiB."""
    for cgroup, unexplained in sorted(model.shmem_unexplained.items()):
        if unexplained >= 64 << 20:
            text = f"about {human(unexplained)} of shmem that no watched mount, SysV"
            text += " segment or memfd region explains (an estimate)"
            remedy = "look for other tmpfs mounts (findmnt -t tmpfs) and memfds of exited processes"
            report.add("info", "memory", shown(cgroup), text, remedy)


def _nccl_in_cumem(report: Report, paths: Paths, deadline: float) -> None:
    """No nccl-* segment: NCCL loaded may keep its SHM transport where no mount shows it."""
    # a D-state process's maps block on its mmap lock: left behind at the deadline
    try:
        users = Bounded(partial(nccl_users, paths)).result(deadline)
    except TimeoutError:
        text = "processes' maps not read within --timeout: NCCL in cuMem host memory not checked"
        report.add("info", "shm", "nccl", text)
        return
    if users:
        text = f"NCCL is loaded ({', '.join(map(shown, users))}) and no nccl-* segment exists:"
        text += " NCCL >= 2.26.3 puts its SHM transport in cuMem host memory when"
        text += " the cuMem probe succeeds (NCCL_CUMEM_HOST_ENABLE), which no mount"
        text += " shows: absent files prove nothing"
        remedy = (
            "NCCL_CUMEM_HOST_ENABLE=0 on every rank puts the buffers back in /dev/shm"
        )
        report.add("info", "shm", "nccl", text, remedy)


def nccl_users(paths: Paths) -> List[str]:
    """'comm[pid]' of processes that map libnccl and do not turn cuMem host memory off."""
    table = ProcessTable(paths)
    found: List[str] = []
    for pid in table.pids():
        try:
            if "libnccl" not in table.maps(pid):
                continue
            environ = read_text(paths.proc(pid, "environ")).split("\0")
        except OSError:
            continue
        if "NCCL_CUMEM_HOST_ENABLE=0" not in environ:
            found.append(f"{table.comm(pid)}[{pid}]")
            if len(found) == MAX_NAMED:
                break
    return found
