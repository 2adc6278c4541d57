"""`shmwatch check`'s report on what the kernel tells: recent OOM kills (its log) and SysV shm
(per IPC namespace in node mode). Split from check.py, which holds the report itself."""

from __future__ import annotations

import time
from typing import Optional

from exporter.check import thresholds as T
from exporter.model.step import Model


def human(n: float) -> str:
    from exporter.check.report import (
        human as _human,
    )  # check.py imports this module: resolved at call time

    return _human(n)


def oom_kills(report, model: Model, error: Optional[str]) -> None:
    """The kernel log's recent OOM kills: victim, cgroups, its shmem RSS, the pod's shm use."""
    if error:
        report.add("info", "memory", "OOM kills", f"kernel log not read: {error}")
        return
    if not model.result_ok("oom"):
        return
    now_usec = (
        time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6
    )  # kmsg stamps: the kernel's clock since boot
    listed = []
    for kill, shm_used in model.recent_oom_kills:
        age = max(0, int((now_usec - kill.boot_usec) / 1e6))
        listed.append(
            {
                "pid": kill.pid,
                "comm": kill.comm,
                "task_memcg": kill.task_memcg,
                "oom_memcg": kill.oom_memcg,
                "pod_uid": kill.pod_uid,
                "age_seconds": age,
                "anon_rss_bytes": kill.anon_rss_bytes,
                "shmem_rss_bytes": kill.shmem_rss_bytes,
                "file_rss_bytes": kill.file_rss_bytes,
                "pod_shm_used_bytes": shm_used,
            }
        )
        rss = "unknown" if kill.shmem_rss_bytes is None else human(kill.shmem_rss_bytes)
        anon = "unknown" if kill.anon_rss_bytes is None else human(kill.anon_rss_bytes)
        shm = "" if shm_used is None else f"; its pod's shm holds {human(shm_used)} now"
        report.add(
            "warn" if age < T.OOM_KILL_RECENT_SECONDS else "info",
            "memory",
            f"OOM kill pid {kill.pid}",
            f"{kill.comm} in {kill.task_memcg or '?'} killed {age} s ago (limit of "
            f"{kill.oom_memcg or 'the host'}): anon-rss {anon}, shmem-rss {rss}{shm}",
            "count /dev/shm in the memory budget (shmem-rss and shm use are charged to the limit)",
        )
    report.facts["oom_kills"] = listed


def sysv(report, namespaces, node_mode: bool) -> None:
    listed = []
    for sysv in namespaces:
        whose = (
            f"pod {sysv.pod_uid}"
            if sysv.pod_uid
            else f"container {sysv.container_id[:12]}"
            if sysv.container_id
            else sysv.namespace
        )
        facts = {
            "ipc_namespace": sysv.namespace,
            "pod_uid": sysv.pod_uid,
            "container_id": sysv.container_id,
            "readable": sysv.readable,
        }
        if not sysv.readable:
            listed.append(facts)
            report.add(
                "info",
                "sysv",
                whose,
                f"SysV shm not visible ({sysv.error}): entering an IPC namespace "
                "needs CAP_SYS_ADMIN",
                "deploy/kubernetes/daemonset-privileged, or run on the host as root",
            )
            continue
        facts.update(
            {
                "segments": len(sysv.segments),
                "bytes": sysv.total_bytes,
                "orphans": sysv.orphans,
                "shmmax_bytes": sysv.shmmax_bytes,
                "shmall_bytes": sysv.shmall_bytes,
                "shmmni": sysv.shmmni,
            }
        )
        listed.append(facts)
        prefix = f"{whose}: " if node_mode else ""
        text = f"{prefix}{len(sysv.segments)} segment(s), {human(sysv.total_bytes)}"
        if sysv.shmmni and len(sysv.segments) > T.SYSV_NEAR_LIMIT_RATIO * sysv.shmmni:
            report.add(
                "warn",
                "sysv",
                "kernel.shmmni",
                f"{text}: near the limit of {sysv.shmmni}",
                "ipcs -m; ipcrm -m <id> for orphans; sysctl -w kernel.shmmni=8192",
            )
        elif (
            sysv.shmall_bytes
            and sysv.total_bytes > T.SYSV_NEAR_LIMIT_RATIO * sysv.shmall_bytes
        ):
            report.add(
                "warn",
                "sysv",
                "kernel.shmall",
                f"{text}: near the limit of {human(sysv.shmall_bytes)}",
                "ipcs -m; ipcrm -m <id>; sysctl kernel.shmall",
            )
        elif sysv.segments or not node_mode:
            report.add(
                "ok",
                "sysv",
                "SysV shm",
                text
                + (
                    f", {sysv.orphans} with nothing attached and their creators gone"
                    if sysv.orphans
                    else ""
                ),
                "ipcs -m; ipcrm -m <id>" if sysv.orphans else "",
            )
    if node_mode:
        report.facts["sysv_namespaces"] = listed
    elif listed:
        report.facts["sysv"] = listed[0]
