"""Shared memory outside the watched mounts: memfd regions, shmem no mount explains, and
NCCL's SHM transport in cuMem host memory (NCCL >= 2.26.3), which leaves no nccl-* file."""

from __future__ import annotations

from typing import List

from exporter.check.deadline import Bounded
from exporter.check.findings import Report
from exporter.check.sizes import human
from exporter.host.paths import Paths, read_text
from exporter.host.proctable import ProcessTable
from exporter.model.step import Model
from exporter.model.summary import memfd_summary

MAX_NAMED = 5  # holders and NCCL users named in a finding


def outside(report: Report, model: Model, paths: Paths, deadline: float) -> None:
    inv = model.inventory
    if inv is None:
        return
    by_class, top = memfd_summary(inv, MAX_NAMED)
    if by_class:
        total = sum(allocated for _, allocated in by_class.values())
        count = sum(count for count, _ in by_class.values())
        holders = ", ".join(
            f"{inv.comms.get(pid, 'unknown')}[{pid}] {human(size)}" for pid, size in top
        )
        text = (
            f"{count} memfd region(s), {human(total)}: shmem charged to the "
            f"writer's cgroup that no mount shows; held by {holders}"
        )
        report.add("info", "memory", "memfd", text)
    for cgroup, unexplained in sorted(model.shmem_unexplained.items()):
        if unexplained >= 64 << 20:
            text = (
                f"about {human(unexplained)} of shmem that no watched mount, SysV segment or "
                "memfd region explains (an estimate)"
            )
            remedy = "look for other tmpfs mounts (findmnt -t tmpfs) and memfds of exited processes"
            report.add("info", "memory", cgroup, text, remedy)
    segments = (s for v in model.mounts if v.inventory for s in v.inventory.segments)
    if not any(s.cls == "nccl" for s in segments):
        # a D-state process's maps block on its mmap lock: left behind at the deadline
        try:
            users = Bounded(lambda: nccl_users(paths)).result(deadline)
        except TimeoutError:
            text = "processes' maps not read within --timeout: NCCL in cuMem host memory not checked"
            report.add("info", "shm", "nccl", text)
            return
        if users:
            text = (
                f"NCCL is loaded ({', '.join(users)}) and no nccl-* segment exists: NCCL "
                ">= 2.26.3 puts its SHM transport in cuMem host memory when the cuMem probe "
                "succeeds (NCCL_CUMEM_HOST_ENABLE), which no mount shows: absent files prove nothing"
            )
            remedy = "NCCL_CUMEM_HOST_ENABLE=0 on every rank puts the buffers back in /dev/shm"
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
