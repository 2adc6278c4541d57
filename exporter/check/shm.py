"""`shmwatch check`'s findings on a shm mount: its size against what is required, its use,
its classes, and the segments nobody holds (leaked, of no known owner, or unverified)."""

from __future__ import annotations

import os
from typing import List, Optional

from exporter.check import thresholds as T
from exporter.check.findings import Report
from exporter.check.sizes import at_least, at_most, docker, human, k8s, round_up
from exporter.model.classes import NOT_LEAKS, REMOVABLE
from exporter.model.step import Model, MountView

MAX_NAMED = 5  # segments, and processes, named in a finding
MOUNT_FACTS = ("mount", "fstype", "size_bytes", "used_bytes", "available_bytes")
REMOUNT = "mount the workload's shm volume at this path"
CLEAN_UP = "remove leaked segments"
TMPFS = "mount a tmpfs (or memory emptyDir) here"
HIDDEN_BY = "NCCL >= 2.19, UCX proc link, torch file_descriptor"
LEAKED = "{count} leaked segment(s) held by no process, {size}: {paths}"
RM = "once no server can attach to them: rm {paths}"
FOREIGN = "{count} file(s) of no known owner class held by no process, {size}: {paths}"
NO_RM = "find which tool made them before removing anything (a container engine's lock file is one)"
UNVERIFIED = (
    "{count} segment(s), {size}, held by no process shmwatch could inspect (could not read "
    "{unreadable}): not called leaked, they may be live"
)
MAY_BE_LIVE = (
    "to tell live from leaked, run shmwatch as the server's UID or with CAP_SYS_PTRACE "
    "(README: Deploy); never remove them on this report's word"
)


def shm_remedy(required: int) -> str:
    """How to get a mount that holds `required` bytes, in the size recommendations round to."""
    size = round_up(required)
    return (
        f"docker run --shm-size={docker(size)} (or --ipc=host); compose shm_size: {docker(size)}b; "
        f"Kubernetes: an emptyDir {{medium: Memory, sizeLimit: {k8s(size)}}} mounted at /dev/shm"
    )


def shm(report: Report, view: MountView, model: Model, required: Optional[int]) -> None:
    m, mount = view.usage, view.usage.mount

    def add(severity: str, message: str, remedy: str = "") -> None:
        report.add(severity, "shm", mount, message, remedy)

    must = "fail" if required else "warn"  # what a required mount's trouble is
    if m.error:
        add(must, f"cannot be measured: {m.error}", REMOUNT)
        return
    effective, default = view.budget.effective_bytes, T.DOCKER_DEFAULT_SHM_BYTES
    size = human(m.size_bytes)
    if m.size_bytes <= default:
        below = "" if m.size_bytes == default else "below "
        size += f" ({below}Docker's 64 MiB default)"
    usage = f"{size}, {human(m.used_bytes)} used ({m.usage_ratio:.0%})"
    facts = {name: getattr(m, name) for name in MOUNT_FACTS}
    facts["effective_size_bytes"] = effective
    report.facts.setdefault("shm", []).append(facts)
    if required and effective < required:
        held = f"can hold {at_most(effective)}, below the {at_least(required)} required"
        add("fail", f"{usage}: {held} (--require-shm)", shm_remedy(required))
    elif m.size_bytes <= default:
        small = f"{usage}: far too small for NCCL, torch or vLLM"
        add("warn", small, shm_remedy(16 << 30))
    if m.usage_ratio > T.SHM_USAGE_CRITICAL_RATIO:
        add(must, f"{usage}: about to be full", f"{CLEAN_UP} (below) or raise the size")
    elif m.usage_ratio > T.SHM_USAGE_WARNING_RATIO:
        above = f"above {T.SHM_USAGE_WARNING_RATIO * 100:g} %"
        add("warn", f"{usage}: {above}", f"{CLEAN_UP} or raise the size")
    if m.fstype != "tmpfs":
        add("warn", f"is {m.fstype}, not tmpfs", TMPFS)
    problems = [f for f in report.findings if f.severity in ("fail", "warn")]
    problem = any(f.subject == mount for f in problems)
    inv, summary = view.inventory, view.summary
    if inv is None or inv.error or summary is None:
        if not problem:
            add("ok", usage)
        return

    def listed(s) -> dict:
        return {"name": s.name, "class": s.cls, "bytes": s.allocated_bytes}

    wall = model.inventory.wall_time
    facts.update(
        bytes_by_class=dict(summary.bytes_by_class),
        orphans=[
            dict(listed(s), age_seconds=max(0, int(wall - s.mtime)))
            for s in summary.leaked
        ],
        unverified=[listed(s) for s in summary.unverified],
        hidden_bytes=summary.hidden_bytes,
        segments=sum(n for n, _, _ in summary.totals.values()),
        unattributed_bytes=inv.unattributed_bytes,
    )
    if not problem:
        by_class = sorted(summary.bytes_by_class.items(), key=lambda kv: -kv[1])
        classes = ", ".join(f"{c} {human(b)}" for c, b in by_class if b)
        add("ok", usage + (f"; by class: {classes}" if classes else ""))
    unowned(add, mount, summary, model.inventory)
    if summary.hidden_count:
        hidden = f"{summary.hidden_count} unlinked-but-mapped segment(s), {human(summary.hidden_bytes)}"
        add("info", f"{hidden}: counted by df, invisible to ls ({HIDDEN_BY})")


def unowned(add, mount: str, summary, inventory) -> None:
    """Segments held by no process, counted by the summary's totals and named by its largest
    few. `rm` is advised only where nothing can still attach: an orphan (every process
    inspected) of a class whose segments belong to one process."""
    unreadable = _unreadable(inventory.proc_unreadable, inventory.unproven)
    totals = summary.totals.items()
    leaks = {c for c, _ in summary.totals} - NOT_LEAKS
    for state, classes, listed, severity, text, remedy in (
        ("orphan", leaks & REMOVABLE, summary.leaked, "warn", LEAKED, RM),
        ("orphan", leaks - REMOVABLE, summary.leaked, "info", FOREIGN, NO_RM),
        ("unverified", leaks, summary.unverified, "info", UNVERIFIED, MAY_BE_LIVE),
    ):
        rows = [v for (c, s), v in totals if s == state and c in classes]
        count, size = sum(r[0] for r in rows), sum(r[1] for r in rows)
        if not count:
            continue
        named = [s.name for s in listed if s.cls in classes][:MAX_NAMED]
        paths = " ".join(os.path.join(mount, name) for name in named)
        if count > len(named):
            paths += f" (+{count - len(named)} more)"
        said = dict(count=count, size=human(size), paths=paths, unreadable=unreadable)
        add(severity, text.format(**said), remedy.format(**said))


def _unreadable(count: Optional[int], unproven: List[str]) -> str:
    """'3 process(es): python3 (pid 7, uid 0); ...': how many, and the first few by name."""
    named = "; ".join(unproven[:MAX_NAMED])
    if count is None:
        # the reasons say what could not be counted (hidepid, a PID namespace of its own)
        return named or "processes hidden from shmwatch, uncounted"
    more = " and more" if len(unproven) > MAX_NAMED or count > len(unproven) else ""
    return f"{count} process(es): {named}{more}" if named else f"{count} process(es)"
