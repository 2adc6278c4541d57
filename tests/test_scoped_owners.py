"""Node mode: an event in one pod's mount rescans that pod's processes only, and what other
pods' processes hold carries over from the last full scan (never turned orphan)."""
import os
import uuid

import pytest

from exporter.collectors.segments import SegmentsCollector
from exporter.inventory.changes import ChangeLog
from exporter.paths import Paths
from exporter.proctable import ProcessTable
from tests.conftest import Peer, mounted_tmpfs, needs_root, remove_cgroup

V1_MEMORY = "/sys/fs/cgroup/memory"
MiB = 1 << 20


def missing(reason):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI: {reason}")
    pytest.skip(reason)


def segment(inv, mount, name):
    [m] = [m for m in inv.mounts if m.mount == mount]
    found = [s for s in m.segments if s.name == name]
    return (found[0].state, found[0].holders) if found else None


def into_pod(cgroup, pid):
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(pid))


@needs_root
def test_an_event_rescans_only_its_pods_processes(tmp_path):
    if not os.path.exists(os.path.join(V1_MEMORY, "cgroup.procs")):
        missing(f"needs the cgroup v1 memory controller at {V1_MEMORY} to put processes in pod cgroups")
    uid_a, uid_b = str(uuid.uuid4()), str(uuid.uuid4())
    cgroups = {uid: os.path.join(V1_MEMORY, "kubepods", "burstable", f"pod{uid}") for uid in (uid_a, uid_b)}
    mount = {uid: f"{tmp_path}/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm"
             for uid in (uid_a, uid_b)}
    for path in cgroups.values():
        os.makedirs(path)
    try:
        with mounted_tmpfs("16m", path=mount[uid_a]) as a, mounted_tmpfs("16m", path=mount[uid_b]) as b, \
                Peer(a, "mapped", "nccl-a", str(MiB)) as pa, Peer(b, "mapped", "nccl-b", str(MiB)) as pb:
            into_pod(cgroups[uid_a], pa.pid)
            into_pod(cgroups[uid_b], pb.pid)
            changes = ChangeLog()
            collector = SegmentsCollector(Paths(), [a, b], ProcessTable(Paths()), pod_of_pid=True, changes=changes)
            inv = collector.collect()
            assert segment(inv, a, "nccl-a") == ("linked", (pa.pid,))
            assert segment(inv, b, "nccl-b") == ("linked", (pb.pid,))
            b_before = next(m for m in inv.mounts if m.mount == b)
            with Peer(a, "mapped", "nccl-a2", str(MiB)) as pa2, Peer(b, "hidden", "nccl-b2", str(MiB)) as pb2:
                into_pod(cgroups[uid_a], pa2.pid)
                into_pod(cgroups[uid_b], pb2.pid)
                changes.add(a, "nccl-a2")  # what the watcher records for a create in pod A's mount
                inv = collector.collect_quick()
                assert collector.wants_follow_up is False  # settled by the scoped scan
                # Pod A was rescanned: its new process is found, holding its new segment.
                assert segment(inv, a, "nccl-a2") == ("linked", (pa2.pid,))
                assert segment(inv, a, "nccl-a") == ("linked", (pa.pid,))
                # Pod B was not: its holdings carried over (not orphaned), and the segment its
                # new process hides is not seen yet ...
                assert segment(inv, b, "nccl-b") == ("linked", (pb.pid,))
                assert segment(inv, b, "nccl-b2") is None
                assert next(m for m in inv.mounts if m.mount == b) is b_before  # not assembled again
                # ... until the full scan of the inventory interval.
                inv = collector.collect()
                assert segment(inv, b, "nccl-b2") == ("hidden", (pb2.pid,))
                assert segment(inv, b, "nccl-b") == ("linked", (pb.pid,))
                assert inv.pods[pa2.pid] == uid_a and inv.pods[pb2.pid] == uid_b
    finally:
        for path in cgroups.values():
            remove_cgroup(path)
        for parent in ("kubepods/burstable", "kubepods"):
            try:
                os.rmdir(os.path.join(V1_MEMORY, parent))
            except OSError:
                pass


@needs_root
def test_a_change_outside_any_pod_asks_for_the_full_follow_up(tmp_path):
    with mounted_tmpfs("16m") as shm:  # not a kubelet path: no pod to scope to
        changes = ChangeLog()
        collector = SegmentsCollector(Paths(), [shm], ProcessTable(Paths()), pod_of_pid=True, changes=changes)
        collector.collect()
        changes.add(shm, "psm_x")
        collector.collect_quick()
        assert collector.wants_follow_up is True
