# mypy: allow-untyped-calls
"""Node mode's cgroup collector on a fixture cgroupfs: every pod's memory cgroup (v2 systemd
and v1 cgroupfs layouts), listed again when a pod comes or goes; a v1 pod's containers' OOM
kills; a steady pod read whole less often while the kernel log counts every kill, never one
near its limit or whose usage or limit moved. Part of the mutation selection."""

import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from exporter.collectors.cgroup import CgroupCollector
from exporter.collectors.source import RunInput
from exporter.model.types import CgroupMemory
from tests.unit.collectors.test_cgroup import GiB, Host

UIDS = ["0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "1a2b3c4d-5e6f-4a5b-9c8d-7e6f5a4b3c2d"]
SLICE = "kubepods.slice/kubepods-burstable.slice"


def systemd_pod(uid: str) -> str:
    return f"{SLICE}/kubepods-burstable-pod{uid.replace('-', '_')}.slice"


@pytest.fixture
def host(tmp_path: Path) -> Host:
    made = Host(tmp_path)
    made.proc.write("meminfo", "MemTotal: 1000 kB\nSwapTotal: 1024 kB\n")
    return made


class NodeCollector(CgroupCollector):
    """Node mode's collector, each run handed whether the kernel log counts every OOM kill,
    as the scheduler hands it."""

    def __init__(self, host: Host, kill_log_complete: bool, **options: Any) -> None:
        super().__init__(host.paths, node_mode=True, **options)
        self.run = RunInput(kill_log_complete=kill_log_complete)

    def collect(self, run: Optional[RunInput] = None) -> List[CgroupMemory]:
        return super().collect(self.run if run is None else run)


def node(
    host: Host, kill_log_complete: bool = False, **options: Any
) -> CgroupCollector:
    return NodeCollector(host, kill_log_complete, **options)


def pods(found: List[CgroupMemory]) -> List[Tuple[str, str, int]]:
    return [(m.cgroup, m.pod_uid, m.usage_bytes) for m in found]


def test_every_pods_cgroup_v2_systemd_layout(host: Host) -> None:
    host.cgroup("/kubepods.slice", 50 * GiB, 60 * GiB)
    host.cgroup(f"/{SLICE}", 20 * GiB)
    host.cgroup("/" + systemd_pod(UIDS[0]), 3 * GiB, 4 * GiB)
    host.cgroup(
        f"/{systemd_pod(UIDS[0])}/cri-containerd-ab.scope", 2 * GiB
    )  # a container: not a pod
    host.cgroup(
        f"/kubepods.slice/kubepods-pod{UIDS[1].replace('-', '_')}.slice", GiB, 2 * GiB
    )
    found = node(host, limit_override=GiB // 2).collect()
    assert pods(found) == [
        (
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UIDS[0].replace('-', '_')}.slice",
            UIDS[0],
            3 * GiB,
        ),
        (
            f"/kubepods.slice/kubepods-pod{UIDS[1].replace('-', '_')}.slice",
            UIDS[1],
            GiB,
        ),
    ]
    # Each pod's own limit: --memory.limit-bytes is one workload's, never a node's pods'.
    assert [(m.limit_bytes, m.limit_source, m.version) for m in found] == [
        (4 * GiB, "pod", 2),
        (2 * GiB, "pod", 2),
    ]
    assert found[0].swap_bytes is None and found[0].child_oom_kills == ()


def test_on_a_node_without_swap_the_pods_swap_is_not_read(host: Host) -> None:
    host.cgroup(
        "/" + systemd_pod(UIDS[0]), GiB, files={"memory.swap.current": "4096\n"}
    )
    assert node(host).collect()[0].swap_bytes == 4096
    host.proc.write("meminfo", "MemTotal: 1000 kB\nSwapTotal: 0 kB\n")
    assert node(host).collect()[0].swap_bytes is None
    host.proc.write("meminfo", "MemTotal: 1000 kB\n")
    assert node(host).collect()[0].swap_bytes == 4096


def v1_pod(host: Host, uid: str, kills: Dict[str, int]) -> str:
    pod = f"/memory/kubepods/burstable/pod{uid}"
    host.cgroup(
        pod,
        GiB,
        2 * GiB,
        version=1,
        files={"memory.oom_control": "oom_kill_disable 0\noom_kill 1\n"},
    )
    for name, count in kills.items():
        host.cgroup(
            f"{pod}/{name}",
            GiB // 2,
            version=1,
            files={"memory.oom_control": f"under_oom 0\noom_kill {count}\n"},
        )
    return pod


def test_a_v1_pods_containers_oom_kills_are_counted_one_by_one(host: Host) -> None:
    v1_pod(host, UIDS[0], {"ctr-a": 2, "ctr-b": 0})
    collector = node(host)
    [pod] = collector.collect()
    path = f"/kubepods/burstable/pod{UIDS[0]}"
    assert (pod.cgroup, pod.version, pod.pod_uid, pod.oom_kills) == (
        path,
        1,
        UIDS[0],
        1,
    )
    assert pod.child_oom_kills == ((f"{path}/ctr-a", 2), (f"{path}/ctr-b", 0))
    # A container gone, another come: listed again.
    shutil.rmtree(
        host.cgroupfs / "memory/kubepods/burstable" / f"pod{UIDS[0]}" / "ctr-b"
    )
    host.cgroup(
        f"/memory/kubepods/burstable/pod{UIDS[0]}/ctr-c",
        1,
        version=1,
        files={"memory.oom_control": "oom_kill 5\n"},
    )
    assert collector.collect()[0].child_oom_kills == (
        (f"{path}/ctr-a", 2),
        (f"{path}/ctr-c", 5),
    )


def test_a_container_whose_oom_counter_cannot_be_read_is_left_out(host: Host) -> None:
    pod = v1_pod(host, UIDS[0], {"ctr-a": 2, "ctr-b": 3})
    collector = node(host)
    collector.collect()
    (host.cgroupfs / pod.lstrip("/") / "ctr-b" / "memory.oom_control").write_text(
        "under_oom 0\n"
    )
    assert [n for n, _ in collector.collect()[0].child_oom_kills] == [
        f"{pod[7:]}/ctr-a"
    ]


def test_pods_nested_too_deep_are_not_pods_of_this_layout(host: Host) -> None:
    host.cgroup(f"/kubepods/a/b/pod{UIDS[0]}", GiB)
    host.cgroup(f"/kubepods/burstable/pod{UIDS[1]}", GiB)
    assert [m.pod_uid for m in node(host).collect()] == [UIDS[1]]


def test_the_first_hierarchy_holding_pods_is_the_memory_controllers(host: Host) -> None:
    v1_pod(host, UIDS[0], {})
    host.cgroup(
        f"/kubepods/burstable/pod{UIDS[1]}", GiB
    )  # a v2 tree beside (hybrid): not read
    assert [(m.pod_uid, m.version) for m in node(host).collect()] == [(UIDS[0], 1)]


def test_a_pod_that_comes_or_goes_is_listed_again(host: Host) -> None:
    host.cgroup("/" + systemd_pod(UIDS[0]), GiB)
    collector = node(host)
    assert [m.pod_uid for m in collector.collect()] == [UIDS[0]]
    host.cgroup("/" + systemd_pod(UIDS[1]), 2 * GiB)
    assert [m.pod_uid for m in collector.collect()] == [UIDS[0], UIDS[1]]
    shutil.rmtree(host.cgroupfs / systemd_pod(UIDS[0]))
    assert [m.pod_uid for m in collector.collect()] == [UIDS[1]]


def test_a_pod_that_cannot_be_read_is_left_out_and_looked_for_again(host: Host) -> None:
    host.cgroup("/" + systemd_pod(UIDS[0]), GiB)
    host.cgroup("/" + systemd_pod(UIDS[1]), 2 * GiB)
    collector = node(host)
    (host.cgroupfs / systemd_pod(UIDS[0]) / "memory.stat").unlink()
    assert [m.pod_uid for m in collector.collect()] == [UIDS[1]]
    (host.cgroupfs / systemd_pod(UIDS[0]) / "memory.stat").write_text("shmem 0\n")
    assert [m.pod_uid for m in collector.collect()] == [UIDS[0], UIDS[1]]


def write(host: Host, uid: str, name: str, text: str) -> None:
    (host.cgroupfs / systemd_pod(uid) / name).write_text(text)


def shmem_seen(
    collector: CgroupCollector, host: Host, written: List[int], uid: str = UIDS[0]
) -> List[Optional[int]]:
    """Each poll's shmem of the pod, its memory.stat written before each as `written` says."""
    seen: List[Optional[int]] = []
    for shmem in written:
        write(host, uid, "memory.stat", f"shmem {shmem}\n")
        [pod] = [m for m in collector.collect() if m.pod_uid == uid]
        seen.append(pod.shmem_bytes)
    return seen


def test_without_the_kernel_log_every_pod_is_read_whole_every_poll(host: Host) -> None:
    host.cgroup("/" + systemd_pod(UIDS[0]), GiB, 4 * GiB)
    assert shmem_seen(node(host), host, [0, 0, 5, 5, 5, 6]) == [0, 0, 5, 5, 5, 6]


def test_a_steady_pod_is_read_whole_after_twice_as_many_polls_each_time(
    host: Host,
) -> None:
    host.cgroup("/" + systemd_pod(UIDS[0]), GiB, 4 * GiB)
    collector = node(host, kill_log_complete=True)
    # Read at poll 1, at 2 (unchanged: steady), at 4 (unchanged), at 8; a change between is
    # seen there, and the pod is read every poll again until it is steady.
    written = [0, 0, 0, 0, 7, 7, 7, 7, 8, 8]
    assert shmem_seen(collector, host, written) == [0, 0, 0, 0, 0, 0, 0, 7, 8, 8]
    collector.close()


def test_a_steady_pod_is_read_at_once_when_its_usage_or_limit_moves(host: Host) -> None:
    host.cgroup("/" + systemd_pod(UIDS[0]), GiB, 4 * GiB)
    collector = node(host, kill_log_complete=True)
    assert shmem_seen(collector, host, [0, 0]) == [0, 0]
    write(host, UIDS[0], "memory.current", f"{GiB + 4096}\n")
    write(host, UIDS[0], "memory.stat", "shmem 99\n")
    [pod] = collector.collect()
    assert (pod.usage_bytes, pod.shmem_bytes) == (GiB + 4096, 99)
    assert shmem_seen(collector, host, [99]) == [99]  # steady again
    write(host, UIDS[0], "memory.max", f"{2 * GiB}\n")
    write(host, UIDS[0], "memory.stat", "shmem 100\n")
    [pod] = collector.collect()
    assert (pod.limit_bytes, pod.shmem_bytes) == (2 * GiB, 100)
    collector.close()


def test_a_pod_near_its_limit_is_read_whole_every_poll(host: Host) -> None:
    """At 80 % of its limit (the dashboard's line; PodOomRiskHigh fires at 90 %), whatever
    pods are skipped before it."""
    host.cgroup(
        "/" + systemd_pod(UIDS[0]), 4 * GiB - 1, 5 * GiB
    )  # just below: stretched
    host.cgroup("/" + systemd_pod(UIDS[1]), 4 * GiB, 5 * GiB)
    collector = node(host, kill_log_complete=True)
    assert shmem_seen(collector, host, [0, 0, 5, 5, 6], uid=UIDS[1]) == [0, 0, 5, 5, 6]
    write(host, UIDS[0], "memory.stat", "shmem 1\n")
    assert collector.collect()[0].shmem_bytes == (4 * GiB - 1) // 2
    collector.close()


def test_a_pod_limited_only_above_it_is_read_at_once_when_that_limit_moves(
    host: Host,
) -> None:
    host.cgroup("/kubepods.slice", 50 * GiB, 60 * GiB)
    host.cgroup(f"/{SLICE}", 40 * GiB, None)
    host.cgroup("/" + systemd_pod(UIDS[0]), GiB, None)
    collector = node(host, kill_log_complete=True)
    assert shmem_seen(collector, host, [0, 0, 5]) == [0, 0, 0]
    (host.cgroupfs / "kubepods.slice" / "memory.max").write_text(
        f"{GiB}\n"
    )  # lowered above it
    [pod] = collector.collect()
    assert (pod.limit_bytes, pod.limit_source, pod.shmem_bytes) == (GiB, "ancestor", 5)
    collector.close()


def test_a_pod_gone_between_polls_is_dropped_and_its_files_closed(host: Host) -> None:
    host.cgroup("/" + systemd_pod(UIDS[0]), GiB, 4 * GiB)
    host.cgroup("/" + systemd_pod(UIDS[1]), GiB, 4 * GiB)
    collector = node(host, kill_log_complete=True)
    collector.collect()
    collector.collect()
    shutil.rmtree(host.cgroupfs / systemd_pod(UIDS[0]))
    assert [m.pod_uid for m in collector.collect()] == [UIDS[1]]
    collector.close()


def test_a_v1_pods_new_container_is_counted(host: Host) -> None:
    pod = v1_pod(host, UIDS[0], {"ctr-a": 2})
    collector = node(host)
    collector.collect()
    host.cgroup(
        f"{pod}/ctr-b", 1, version=1, files={"memory.oom_control": "oom_kill 4\n"}
    )
    path = pod[len("/memory") :]
    assert collector.collect()[0].child_oom_kills == (
        (f"{path}/ctr-a", 2),
        (f"{path}/ctr-b", 4),
    )


def open_under(directory: Path) -> int:
    """This process's open files below `directory` (other tests' threads open and close theirs)."""
    count = 0
    for fd in os.listdir(f"/proc/{os.getpid()}/fd"):
        try:
            count += os.readlink(f"/proc/{os.getpid()}/fd/{fd}").startswith(
                f"{directory}/"
            )
        except OSError:
            continue  # closed meanwhile
    return count


def test_the_files_kept_open_are_closed_with_their_pod(host: Host) -> None:
    for uid in UIDS:
        host.cgroup("/" + systemd_pod(uid), GiB, 4 * GiB)
    collector = node(host, kill_log_complete=True)
    collector.collect()
    assert open_under(host.cgroupfs) == 4  # each pod's usage and limit
    shutil.rmtree(host.cgroupfs / systemd_pod(UIDS[0]))
    collector.collect()
    assert open_under(host.cgroupfs) == 2
    collector.close()
    assert open_under(host.cgroupfs) == 0


def test_a_usage_that_moved_in_its_first_digit_is_read_at_once(host: Host) -> None:
    host.cgroup("/" + systemd_pod(UIDS[0]), GiB, 4 * GiB)
    collector = node(host, kill_log_complete=True)
    assert shmem_seen(collector, host, [0, 0]) == [0, 0]
    write(host, UIDS[0], "memory.current", f"{GiB + GiB}\n")  # 1073741824 -> 2147483648
    write(host, UIDS[0], "memory.stat", "shmem 5\n")
    assert [m.shmem_bytes for m in collector.collect()] == [5]
    collector.close()


def test_a_pod_unread_for_want_of_fds_fails_the_run_a_gone_one_is_left_out(host: Host) -> None:
    """EMFILE says nothing of the pod: taken for gone, its OOM counts would leave the ledger
    an hour later. A pod whose files are gone (deleted since it was listed) is left out."""
    import errno
    import resource

    for uid in UIDS:
        host.cgroup("/" + systemd_pod(uid), GiB, 2 * GiB)
    collector = node(host)
    gone, kept = collector.pod_cgroups()
    os.unlink(os.path.join(gone.directory, "memory.stat"))
    assert collector._read_pod(gone, None, None, {}, False, False) is None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))  # every open now fails: EMFILE
    try:
        with pytest.raises(OSError) as raised:
            collector._read_pod(kept, None, None, {}, False, False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert raised.value.errno == errno.EMFILE
    assert collector._read_pod(kept, None, None, {}, False, False) is not None


def test_a_pass_cut_short_keeps_the_pods_it_did_not_reach_and_closes_them_when_gone(host: Host) -> None:
    """The pods after the one whose read ran out of fds keep their readings and their open
    files; deleted later, their files are closed (they were forgotten, and held for good)."""
    import resource

    for uid in UIDS:
        host.cgroup("/" + systemd_pod(uid), GiB, 2 * GiB)
    collector = node(host)
    first, second = listed = collector.pod_cgroups()
    assert len(collector.read_pods(listed, stretch=True)) == 2 and second.directory in collector._fds
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))  # every open now fails: EMFILE
    try:
        with pytest.raises(OSError):
            collector.read_pods(listed, stretch=True)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert second.directory in collector._kept
    shutil.rmtree(second.directory)
    assert [m.pod_uid for m in collector.read_pods(collector.pod_cgroups(), stretch=True)] == [first.pod_uid]
    assert second.directory not in collector._fds
