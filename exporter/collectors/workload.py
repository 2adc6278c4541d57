"""The sidecar's workload: its processes, where its memory cgroup can be read, and, where it
cannot, an estimate of what the cgroup is charged.

A sidecar shares the server's PID namespace, not its cgroup (Docker on v1 mounts only the
sidecar's own; v2 namespaces hide every other). The workload is every process of the
namespace that is not shmwatch's nor a pod's pause process; its cgroup is read where a
cgroupfs mount shows it (the host's, read-only: /proc/<pid>/cgroup is relative to the
cgroup namespace's root, a mount shows the subtree below its mountinfo root).

Otherwise it is estimated (`cgroup="estimate:workload"`, shmwatch_cgroup_memory_estimated 1):
Pss_Anon + Pss_File (smaps_rollup) plus the shm mounts' used bytes (not Pss_Shmem: shm counted
once). Unseen: unmapped page cache, kernel memory; overcounted: others' file pages.
"""

import os
import posixpath
from contextlib import suppress
from typing import Iterable, List, Optional, Sequence

from exporter.host.mountinfo import MountEntry
from exporter.host.paths import Paths
from exporter.host.proctable import Process, ProcessTable

ESTIMATE_CGROUP = "estimate:workload"
# Where the memory controller's files are below /sys/fs/cgroup: (directory, cgroup version).
# v1 (or hybrid) first; a memory cgroup is told by its usage file (USAGE).
HIERARCHIES = (("memory", 1), ("", 2), ("unified", 2))
# A pod's sandbox process: in the shared PID namespace of a Kubernetes pod, but not the workload.
SANDBOX_COMMS = ("pause",)


class IncompleteView(LookupError):
    """Some of the workload's processes could not be read: no estimate rather than a low one."""


def workload_processes(table: ProcessTable, own_pid: int) -> List[Process]:
    """The processes of our PID namespace that are not ours, lowest pid first (the caller
    asks only outside the host's namespace, which is nobody's workload)."""
    try:
        own = table.cgroups("self")
    except OSError:
        return []  # without our own cgroup, ours cannot be told from the workload's
    walked, found = table.walk(), []
    # Processes we cannot read (another UID, hidepid) may be the workload's: an estimate
    # without them would be low, and unmarked as such. Say so instead.
    if walked.unreadable or walked.invisible != 0:  # None: not known
        raise IncompleteView(
            f"{walked.unreadable or 0} process(es) in this PID namespace could not be read"
            + ("" if walked.invisible == 0 else " and some are hidden by hidepid")
            + ": the workload's memory cannot be estimated (give shmwatch the server's UID or "
            "CAP_SYS_PTRACE, or the host's cgroupfs)"
        )
    for proc in walked.processes:
        if proc.pid == own_pid or proc.comm in SANDBOX_COMMS or _shmwatch(table, proc):
            continue
        try:
            if table.cgroups(proc.pid) == own:
                continue  # shmwatch's own processes (a shell exec'd into the sidecar)
        except FileNotFoundError:
            continue  # gone since the walk
        except OSError as err:
            raise IncompleteView(
                f"the cgroup of process {proc.pid} could not be read ({err.strerror or err}): "
                "the workload's memory cannot be estimated"
            ) from None
        found.append(proc)
    return sorted(found, key=lambda p: p.pid)


def _shmwatch(table: ProcessTable, proc: Process) -> bool:
    """A second sidecar: `[python] shmwatch ...` or `python3 -m exporter ...` (not by comm,
    which a Python server shares)."""
    with suppress(OSError):
        words = table.cmdline(proc.pid).split()
        module = words[1:3] == ["-m", "exporter"]
        return module or any(os.path.basename(w) == "shmwatch" for w in words[:2])
    return False


def below(path: str, root: str) -> Optional[List[str]]:
    """`path`'s components below `root`, both relative to one cgroup namespace root (either may
    climb out of it with leading '..'); None when `path` is not at or below `root`."""
    # 64 stand-ins for the directories above the namespace root, which a leading '..' climbs.
    p, r = (
        posixpath.normpath("/\0" * 64 + "/" + t).split("/")[1:] for t in (path, root)
    )
    if p[: len(r)] != r or any(part.startswith("\0") for part in p[len(r) :]):
        # Not below the mount, or below it through directories whose names this namespace
        # cannot tell (a v2 path /../<id> under a mount rooted at /../..): not guessed.
        return None
    return p[len(r) :]


def cgroup_directories(
    entries: Iterable[MountEntry], path: str, version: int
) -> List[str]:
    """Every directory a mounted cgroupfs shows `path` at (v1: a memory hierarchy; v2: cgroup2)."""
    out = []
    for entry in entries:
        v1 = entry.fstype == "cgroup" and "memory" in entry.options.split(",")
        rest = below(path, entry.root)
        if rest is not None and (v1 if version == 1 else entry.fstype == "cgroup2"):
            out.append(os.path.join(entry.mount_point, *rest))
    return out


def shm_used(paths: Paths, mounts: Iterable[str]) -> int:
    """Bytes used on the watched mounts, each filesystem once (one tmpfs may be watched twice)."""
    used = {}  # by device
    for mount in mounts:
        where = paths.host(mount)
        with suppress(OSError):
            st, device = os.statvfs(where), os.stat(where).st_dev
            used[device] = (st.f_blocks - st.f_bfree) * st.f_frsize
    return sum(used.values())


def resident(table: ProcessTable, processes: Sequence[Process]) -> int:
    """Proportional anonymous + file-backed resident bytes of `processes` (shm left out)."""
    total, unreadable = 0, []
    for proc in processes:
        try:
            rollup = table.smaps_rollup(proc.pid)
        except FileNotFoundError:
            continue  # exited: it holds nothing now
        except OSError:
            unreadable.append(f"{proc.comm}[{proc.pid}]")
            continue
        if "Pss_Anon" in rollup:
            total += rollup["Pss_Anon"] + rollup.get("Pss_File", 0)
        else:  # before Linux 5.? smaps_rollup has no Pss_Anon: Pss less what is shm
            total += max(0, rollup.get("Pss", 0) - rollup.get("Pss_Shmem", 0))
    if unreadable:
        # Part of the picture would be a confident understatement: no estimate at all.
        raise PermissionError(
            f"cannot estimate the workload's memory: smaps_rollup of {', '.join(unreadable[:5])} "
            f"not readable (run shmwatch as the server's UID or with CAP_SYS_PTRACE, or give it "
            f"the host's cgroupfs read-only)"
        )
    return total
