# mypy: allow-untyped-calls
"""`shmwatch check`'s findings beyond the mounts, word for word: recent OOM kills (victim, its
cgroups, shmem RSS, its pod's shm now), SysV per IPC namespace (near a limit, orphans with
`ipcrm`, namespaces not readable), memfd holders, shmem no mount explains, NCCL in cuMem host
memory. Models built by hand and /proc trees: part of the mutation selection."""

import os
import time
from pathlib import Path
from dataclasses import replace
from typing import Any, List, Optional, Tuple

from exporter.check import thresholds as T
from exporter.check.findings import Report
from exporter.check.kernel import nccl_users, oom_kills, outside, sysv
from exporter.check.report import diagnose
from exporter.model.state import MountStates
from exporter.model.step import Model, MountView, RecentOomKill, SourceStatus
from exporter.model.types import (
    CgroupMemory,
    Inventory,
    MemfdTotals,
    MountInventory,
    OomKill,
    Segment,
    SysvSegment,
    SysvShm,
)
from tests.helpers import FakeProc, maps_line

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
POD = "0a0b0c0d-1111-2222-3333-444455556666"
# check's SysV advice: prose, not a line to paste (the IDs are ipcs's, in the namespace's view)
IPCRM = "remove orphans (list them with ipcs -m, remove each with ipcrm -m ID)"


EMPTY = Model(
    False, [], [], None, [], None, [], None, [], MountStates({}, {}, {}, {}, {})
)


def model(**fields: Any) -> Model:
    return replace(EMPTY, **fields)


def found(report: Report) -> List[Tuple[str, str, str, str, str]]:
    return [
        (f.severity, f.area, f.subject, f.message, f.remedy) for f in report.findings
    ]


KILL = OomKill(
    1,
    0,
    42,
    "python3",
    f"/kubepods/pod{POD}/ctr",
    f"/kubepods/pod{POD}",
    "CONSTRAINT_MEMCG",
    8 * MiB,
    KiB,
    2 * GiB,
)


def kill(age_seconds: float, pid: int = 42, **fields: Any) -> OomKill:
    """A kill `age_seconds` (and half a second) ago, as the kernel log stamps it."""
    now_usec = time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6
    return replace(
        KILL, boot_usec=int(now_usec - (age_seconds + 0.5) * 1e6), pid=pid, **fields
    )


def facts(report: Report, name: str) -> Any:
    """One of the report's facts, as its JSON has it."""
    return report.facts[name]


OOM_OK = [SourceStatus("oom", True)]
REMEDY = "count /dev/shm in the memory budget (shmem-rss and shm use are charged to the limit)"


def test_a_recent_oom_kill_is_a_warning_with_its_cgroups_and_shm() -> None:
    report = Report()
    oom_kills(
        report, model(statuses=OOM_OK, recent_oom_kills=[RecentOomKill(kill=kill(10), shm_used_bytes=3 * GiB)]), None
    )
    assert found(report) == [
        (
            "warn",
            "memory",
            "OOM kill pid 42",
            f"python3 in /kubepods/pod{POD}/ctr killed 10 s ago (limit of /kubepods/pod{POD}): anon-rss 8.0 MiB, "
            "shmem-rss 2.0 GiB; its pod's shm holds 3.0 GiB now",
            REMEDY,
        )
    ]
    [listed] = facts(report, "oom_kills")
    assert listed == dict(
        pid=42,
        comm="python3",
        task_memcg=f"/kubepods/pod{POD}/ctr",
        oom_memcg=f"/kubepods/pod{POD}",
        pod_uid=POD,
        anon_rss_bytes=8 * MiB,
        shmem_rss_bytes=2 * GiB,
        file_rss_bytes=KiB,
        age_seconds=10,
        pod_shm_used_bytes=3 * GiB,
    )


def test_an_older_kill_is_information_and_what_is_unknown_is_said() -> None:
    report = Report()
    old = kill(
        T.OOM_KILL_RECENT_SECONDS,
        7,
        task_memcg="",
        oom_memcg="",
        anon_rss_bytes=None,
        shmem_rss_bytes=None,
    )
    recent = kill(T.OOM_KILL_RECENT_SECONDS - 1, 8, comm="vllm")
    oom_kills(
        report,
        model(statuses=OOM_OK, recent_oom_kills=[RecentOomKill(kill=old, shm_used_bytes=None), RecentOomKill(kill=recent, shm_used_bytes=None)]),
        None,
    )
    assert [f[0] for f in found(report)] == ["info", "warn"]
    assert found(report)[0][3] == (
        f"python3 in ? killed {T.OOM_KILL_RECENT_SECONDS} s ago (limit of the host): anon-rss unknown, shmem-rss unknown"
    )
    assert facts(report, "oom_kills")[0]["pod_shm_used_bytes"] is None


def test_a_kill_stamped_after_now_is_zero_seconds_old() -> None:
    report = Report()
    oom_kills(
        report, model(statuses=OOM_OK, recent_oom_kills=[RecentOomKill(kill=kill(-100), shm_used_bytes=None)]), None
    )
    assert facts(report, "oom_kills")[0]["age_seconds"] == 0


def test_a_kernel_log_not_read_is_said_and_reports_no_kills() -> None:
    report = Report()
    oom_kills(
        report, model(statuses=[SourceStatus("oom", False, 0.0, "EPERM")]), "EPERM"
    )
    assert found(report) == [
        ("info", "memory", "OOM kills", "kernel log not read: EPERM", "")
    ]
    assert "oom_kills" not in report.facts
    quiet = Report()
    oom_kills(
        quiet, model(recent_oom_kills=[RecentOomKill(kill=kill(1), shm_used_bytes=None)]), None
    )  # the collector off
    assert quiet.findings == [] and "oom_kills" not in quiet.facts
    none = Report()
    oom_kills(none, model(statuses=OOM_OK), None)
    assert none.findings == [] and facts(none, "oom_kills") == []


def segments(count: int, size: int = 4096, orphans: int = 0) -> List[SysvSegment]:
    return [
        SysvSegment(
            i, 100 + i, size, 0 if i < orphans else 1, 500, size, orphan=i < orphans
        )
        for i in range(count)
    ]


def ns(
    segs: List[SysvSegment],
    shmmni: Optional[int] = 4096,
    shmall: Optional[int] = 64 * GiB,
    **fields: Any,
) -> SysvShm:
    return SysvShm(segs, 32 * GiB, shmall, shmmni, **fields)


def test_sysv_in_a_sidecar_counts_and_orphans_with_their_ipcrm() -> None:
    report = Report()
    sysv(report, [ns(segments(3, 8 * MiB, orphans=2))], node_mode=False)
    assert found(report) == [
        (
            "ok",
            "sysv",
            "SysV shm",
            "3 segment(s), 24.0 MiB, 2 with nothing attached and their creators gone",
            IPCRM,
        )
    ]
    assert facts(report, "sysv") == dict(
        ipc_namespace="",
        pod_uid="",
        container_id="",
        readable=True,
        segments=3,
        bytes=24 * MiB,
        orphans=2,
        shmmax_bytes=32 * GiB,
        shmall_bytes=64 * GiB,
        shmmni=4096,
    )
    empty = Report()
    sysv(empty, [ns([])], node_mode=False)
    assert found(empty) == [("ok", "sysv", "SysV shm", "0 segment(s), 0 B", "")]
    nothing = Report()
    sysv(nothing, [], node_mode=False)
    assert nothing.findings == [] and nothing.facts == {}


def test_sysv_near_its_segment_limit() -> None:
    report = Report()
    sysv(report, [ns(segments(91), shmmni=100)], node_mode=False)
    assert found(report) == [
        (
            "warn",
            "sysv",
            "kernel.shmmni",
            "91 segment(s), 364.0 KiB: near the limit of 100",
            f"{IPCRM} or raise the limit: sysctl -w kernel.shmmni=8192",
        )
    ]
    at = Report()
    sysv(at, [ns(segments(90), shmmni=100)], node_mode=False)
    assert found(at)[0][0] == "ok"


def test_sysv_near_its_byte_limit() -> None:
    report = Report()
    sysv(report, [ns(segments(1, 91 * MiB), shmall=100 * MiB)], node_mode=False)
    assert found(report) == [
        (
            "warn",
            "sysv",
            "kernel.shmall",
            "1 segment(s), 91.0 MiB: near the limit of 100.0 MiB",
            f"{IPCRM} or raise the limit: sysctl kernel.shmall",
        )
    ]
    at = Report()
    sysv(
        at, [ns(segments(1, 90 * MiB), shmall=100 * MiB, shmmni=None)], node_mode=False
    )
    assert found(at)[0][0] == "ok"
    unknown = Report()
    sysv(unknown, [ns(segments(1, 90 * MiB), shmall=None, shmmni=0)], node_mode=False)
    assert found(unknown)[0][0] == "ok"


def test_node_mode_names_each_namespace_and_skips_empty_ones() -> None:
    namespaces = [
        ns(segments(2, MiB, orphans=1), namespace="ipc:[1]", pod_uid=POD),
        ns([], namespace="ipc:[2]", pod_uid="u2"),  # nothing there: not said
        ns(
            [],
            None,
            None,
            namespace="ipc:[5]",
            pod_uid="u5",
            readable=False,
            error="Operation not permitted",
        ),
        ns(segments(1), namespace="ipc:[3]", container_id="ab" * 32),
        ns(segments(1), namespace="ipc:[4]"),
    ]
    report = Report()
    sysv(report, namespaces, node_mode=True)
    assert found(report) == [
        (
            "ok",
            "sysv",
            "SysV shm",
            f"pod {POD}: 2 segment(s), 2.0 MiB, 1 with nothing attached and their creators gone",
            IPCRM,
        ),
        (
            "info",
            "sysv",
            "pod u5",
            "SysV shm not visible (Operation not permitted): entering an IPC namespace needs "
            "CAP_SYS_ADMIN",
            "deploy/kubernetes/daemonset-privileged, or run on the host as root",
        ),
        ("ok", "sysv", "SysV shm", "container abababababab: 1 segment(s), 4.0 KiB", ""),
        ("ok", "sysv", "SysV shm", "ipc:[4]: 1 segment(s), 4.0 KiB", ""),
    ]
    namespaces_said = facts(report, "sysv_namespaces")
    assert [f["ipc_namespace"] for f in namespaces_said] == [
        "ipc:[1]",
        "ipc:[2]",
        "ipc:[5]",
        "ipc:[3]",
        "ipc:[4]",
    ]
    assert namespaces_said[2] == dict(
        ipc_namespace="ipc:[5]", pod_uid="u5", container_id="", readable=False
    )
    assert "sysv" not in report.facts
    through = diagnose(
        model(node_mode=True, sysv=namespaces[:1])
    )  # check's report passes the mode on
    assert [f.message for f in through.findings if f.area == "sysv"][0].startswith(
        f"pod {POD}: 2 segment(s)"
    )


def memfd(name: str, cls: str, size: int, holders: Tuple[int, ...]) -> Segment:
    return Segment(
        name, cls, "hidden", size, size, 0.0, tuple(holders), (1, hash(name) & 0xFFFF)
    )


def test_memfd_holders_and_shmem_no_mount_explains(tmp_path: Path) -> None:
    inv = Inventory(
        [],
        {7: "vllm"},
        0,
        1,
        memfd=[
            memfd("cuda.shm.0", "cuda", 64 * MiB, (7, 9)),
            memfd("x", "other", MiB, (9,)),
        ],
        memfd_rest={7: {"cuda": MemfdTotals(count=3, allocated_bytes=3 * MiB)}},
        cgroup_of={7: "/pod/a", 9: "/pod/b"},
    )
    cgroups = [
        CgroupMemory("/pod/a", 2, 1, None, 1, 200 * MiB, None, "none"),
        CgroupMemory("/pod/b", 2, 1, None, 1, 128 * MiB, None, "none"),
    ]
    nccl = MountView(
        "/dev/shm",
        {},
        None,
        None,
        None,
        None,
        _inventory_with(Segment("nccl-1", "nccl", "linked", 1, 1)),
        None,
        None,
        None,
    )
    proc = FakeProc(str(tmp_path))
    nccl_process(
        proc, 10, "vllm", ""
    )  # NCCL loaded, and its segment is there: nothing to say
    report = Report()
    outside(
        report,
        model(inventory=inv, cgroups=cgroups, mounts=[nccl]),
        proc.paths,
        time.monotonic() + 5,
    )
    assert found(report) == [
        (
            "info",
            "memory",
            "memfd",
            "5 memfd region(s), 68.0 MiB: shmem charged to the writer's cgroup that no mount "
            "shows; held by vllm[7] 67.0 MiB, unknown[9] 65.0 MiB",
            "",
        ),
        (
            "info",
            "memory",
            "/pod/a",
            "about 133.0 MiB of shmem that no watched mount, SysV segment or memfd region "
            "explains (an estimate)",
            "look for other tmpfs mounts (findmnt -t tmpfs) and memfds of exited processes",
        ),
    ]


def _inventory_with(*segs: Segment) -> MountInventory:
    return MountInventory("/dev/shm", hidden=tuple(segs))


def test_shmem_unexplained_just_under_64_mib_is_not_said(tmp_path: Path) -> None:
    inv = Inventory([], {}, 0, 1)
    cgroups = [
        CgroupMemory("/a", 2, 1, None, 1, 64 * MiB - 1, None, "none"),
        CgroupMemory("/b", 2, 1, None, 1, 64 * MiB, None, "none"),
    ]
    report = Report()
    outside(
        report,
        model(inventory=inv, cgroups=cgroups),
        FakeProc(str(tmp_path)).paths,
        time.monotonic() + 5,
    )
    assert [f[2] for f in found(report)] == ["/b"]


def nccl_process(proc: FakeProc, pid: int, comm: str, environ: str) -> None:
    proc.add(
        pid,
        comm,
        maps=maps_line(0x1000, 0x2000, 0x801, 77, "/usr/lib/libnccl.so.2.27.3"),
    )
    proc.write(f"{pid}/environ", environ)


def test_nccl_in_cumem_host_memory_is_named_when_no_nccl_segment_exists(
    tmp_path: Path,
) -> None:
    proc = FakeProc(str(tmp_path / "proc"))
    nccl_process(proc, 10, "vllm", "PATH=/bin\0NCCL_DEBUG=INFO\0")
    nccl_process(
        proc, 11, "python3", "NCCL_CUMEM_HOST_ENABLE=0\0"
    )  # turned off: in /dev/shm
    nccl_process(proc, 12, "ray", "")
    proc.add(13, "sh", maps="00400000-00401000 r-xp 0 08:01 5 /bin/sh\n")
    proc.add(
        14,
        "python3",
        maps=maps_line(0x1000, 0x2000, 0x801, 77, "/usr/lib/libnccl.so.2"),
    )  # environ gone
    report = Report()
    outside(
        report,
        model(inventory=Inventory([], {}, 0, 1)),
        proc.paths,
        time.monotonic() + 5,
    )
    [(severity, area, subject, text, remedy)] = found(report)
    assert (severity, area, subject) == ("info", "shm", "nccl")
    # Named in /proc's listing order: a real /proc's is the pids', a fixture directory's the
    # filesystem's (a tmpfs lists the newest first).
    named, _, rest = text.removeprefix("NCCL is loaded (").partition(") and no nccl-* ")
    assert sorted(named.split(", ")) == ["ray[12]", "vllm[10]"]
    assert rest == (
        "segment exists: NCCL >= 2.26.3 puts its SHM transport in cuMem host memory when the "
        "cuMem probe succeeds (NCCL_CUMEM_HOST_ENABLE), which no mount shows: absent files "
        "prove nothing"
    )
    assert text.startswith("NCCL is loaded (")
    assert remedy == "NCCL_CUMEM_HOST_ENABLE=0 on every rank puts the buffers back in /dev/shm"


def test_nccl_users_are_named_up_to_five(tmp_path: Path) -> None:
    proc = FakeProc(str(tmp_path / "proc"))
    for pid in range(20, 27):
        nccl_process(proc, pid, f"rank{pid}", "")
    users = nccl_users(proc.paths)  # in /proc's order
    assert len(users) == 5 and set(users) < {
        f"rank{pid}[{pid}]" for pid in range(20, 27)
    }


def test_no_nccl_user_no_nccl_finding_and_none_without_an_inventory(
    tmp_path: Path,
) -> None:
    proc = FakeProc(str(tmp_path / "proc"))
    proc.add(10, "sh")
    report = Report()
    outside(
        report,
        model(inventory=Inventory([], {}, 0, 1)),
        proc.paths,
        time.monotonic() + 5,
    )
    assert report.findings == []
    nccl_process(proc, 11, "vllm", "")
    outside(report, model(), proc.paths, time.monotonic() + 5)
    assert report.findings == []


def test_maps_not_read_in_time_are_said(tmp_path: Path) -> None:
    """A process in D state blocks a read of its maps: left behind at the deadline."""
    proc = FakeProc(str(tmp_path / "proc"))
    proc.add(10, "vllm")
    os.unlink(proc.path(10, "maps"))
    os.mkfifo(proc.path(10, "maps"))  # its open blocks until a writer comes
    report = Report()
    try:
        outside(
            report,
            model(inventory=Inventory([], {}, 0, 1)),
            proc.paths,
            time.monotonic() + 0.2,
        )
    finally:
        with open(proc.path(10, "maps"), "w"):
            pass  # the reader goes on, and ends
    assert found(report) == [
        (
            "info",
            "shm",
            "nccl",
            "processes' maps not read within --timeout: NCCL in cuMem host memory not checked",
            "",
        )
    ]


ORPHAN = SysvSegment(key=0, shmid=7, size_bytes=4096, nattch=0, cpid=1, rss_bytes=0, orphan=True)


def remedies(namespace: SysvShm) -> List[str]:
    """check's advice for one namespace, in a sidecar."""
    report = Report()
    sysv(report, [namespace], False)
    return [f.remedy for f in report.findings]


def test_sysv_advice_is_prose_without_shell_metacharacters() -> None:
    # `ipcrm -m <id>` pasted into a shell read a file `id` and wrote one named `for`.
    ok = remedies(SysvShm([ORPHAN], 1 << 40, 1 << 40, 4096))
    near = remedies(SysvShm([ORPHAN] * 4, 1 << 40, 1 << 40, 4))
    assert ok == ["remove orphans (list them with ipcs -m, remove each with ipcrm -m ID)"]
    assert near == ["remove orphans (list them with ipcs -m, remove each with ipcrm -m ID) or raise the limit: "
                    "sysctl -w kernel.shmmni=8192"]
    assert not any(c in r for r in ok + near for c in "<>;|&$`")
