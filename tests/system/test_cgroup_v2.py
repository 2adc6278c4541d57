"""cgroup v2 on the systemd driver's layout (tests/fixtures/cgroup2): the effective limit is the
smallest memory.max up the tree (pod-level limits, KEP-2837), memory.high, memory.events and
swap; real tmpfs mounts for the shm side. The real-kernel v2 run is tests/vm/test_cgroup_v2_vm.py."""
import os
import shutil

import pytest

from exporter.app import App
from exporter.config import parse_args
from exporter.collectors.cgroup import CgroupCollector
from exporter.collectors.host_memory import usable_limit_flag
from exporter.collectors.shm_mount import ShmMountCollector
from exporter.collectors.source import Source
from exporter.collectors.cgroup import ESTIMATE_CGROUP
from exporter.model.types import CgroupMemory
from exporter.host.paths import Paths
from tests.conftest import EVERY_FAMILY, Exporter, fallocate, mounted_tmpfs, needs_root, value
from tests.helpers import registry_for

MiB = 1 << 20
FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "cgroup2")
UID_A = "2f0c5d6e-1a2b-4c3d-8e9f-0a1b2c3d4e5f"  # burstable, 256 MiB on the pod, none on its container
UID_B = "7a8b9c0d-1e2f-4a3b-9c4d-5e6f7a8b9c0d"  # best effort: 128 MiB on its docker scope only
UID_G = "3c4d5e6f-7a8b-4c9d-8e0f-1a2b3c4d5e6f"  # guaranteed: 512 MiB on the pod, 384 MiB on the container
POD_A = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_A.replace('-', '_')}.slice"
SCOPE_A = POD_A + "/cri-containerd-" + "ab" * 32 + ".scope"
POD_B = f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_B.replace('-', '_')}.slice"
POD_G = f"/kubepods.slice/kubepods-pod{UID_G.replace('-', '_')}.slice"
SCOPE_G = POD_G + "/cri-containerd-" + "ef" * 32 + ".scope"
KTHREADD_STAT = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 2 0 0\n"


def tree(tmp_path, self_cgroup=SCOPE_A, mem_total=None):
    """The fixture's cgroupfs, and a /proc whose `self` is in `self_cgroup` (host PID namespace)."""
    sys_root = tmp_path / "sys"
    shutil.copytree(os.path.join(FIXTURE, "sys"), sys_root)
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(f"0::{self_cgroup}\n")
    (proc / "2").mkdir()
    (proc / "2" / "stat").write_text(KTHREADD_STAT)
    if mem_total is not None:
        (proc / "meminfo").write_text(f"MemTotal: {mem_total // 1024} kB\nMemAvailable: 1024 kB\n")
    return Paths(procfs=str(proc), sysfs=str(sys_root))


def cgroup_dir(paths, cgroup):
    return paths.sys("fs", "cgroup") + cgroup


def test_pod_level_limit_binds_a_container_without_one(tmp_path):
    """The acceptance shape: the container scope (what a sidecar's --cgroup.path names) has no
    memory.max, its pod slice 256 MiB; 150 MiB of shm in a 1 GiB tmpfs. Before: no limit, no
    ratios, an effective size of the whole 1 GiB."""
    paths = tree(tmp_path)
    # At the pod's emptyDir path, as a host-mode exporter watching a pod's volume names it.
    shm = f"{tmp_path}/var/lib/kubelet/pods/{UID_A}/volumes/kubernetes.io~empty-dir/dshm"
    with mounted_tmpfs("1g", path=shm):
        fallocate(os.path.join(shm, "psm_kv"), 150 * MiB)
        cgroups = CgroupCollector(paths, cgroup_path=cgroup_dir(paths, SCOPE_A))
        reg, _ = registry_for(ShmMountCollector(Paths()), cgroups, mounts=[shm])
        got = reg.get_sample_value
        cg = {"cgroup": SCOPE_A}
        assert got("shmwatch_cgroup_memory_limit_bytes", {**cg, "limit_from": "pod"}) == 256 * MiB
        projection = got("shmwatch_shm_oom_projection_ratio", {"mount": shm, **cg})
        assert projection is not None and projection > 1
        effective = got("shmwatch_mount_effective_size_bytes", {"mount": shm})
        assert effective is not None and effective <= 256 * MiB
        assert got("shmwatch_oom_risk_ratio", cg) == pytest.approx(165 / 256)
        # memory.high on the scope, its events as counters, swap; no swap limit where "max".
        assert got("shmwatch_cgroup_memory_high_bytes", cg) == 200 * MiB
        assert got("shmwatch_cgroup_memory_events_total", {**cg, "event": "high"}) == 9
        assert got("shmwatch_cgroup_memory_events_total", {**cg, "event": "oom_group_kill"}) == 0
        assert got("shmwatch_cgroup_memory_swap_bytes", cg) == 0
        assert got("shmwatch_cgroup_memory_swap_limit_bytes", cg) is None


def test_where_the_limit_binds(tmp_path):
    paths = tree(tmp_path)

    def read(cgroup):
        return CgroupCollector(paths, cgroup_path=cgroup_dir(paths, cgroup)).collect()[0]

    assert (read(SCOPE_G).limit_bytes, read(SCOPE_G).limit_source) == (384 * MiB, "self")
    assert (read(POD_G).limit_bytes, read(POD_G).limit_source) == (512 * MiB, "pod")
    # No limit on the pod or its QoS slice: the node's allocatable on kubepods.slice binds.
    assert (read(POD_B).limit_bytes, read(POD_B).limit_source) == (16 << 30, "ancestor")
    b = read(POD_B + "/docker-" + "cd" * 32 + ".scope")
    assert (b.limit_bytes, b.limit_source, b.swap_bytes, b.swap_limit_bytes) == (128 * MiB, "self", 4 * MiB, 64 * MiB)
    assert read(SCOPE_A).high_bytes == 200 * MiB and read(POD_A).high_bytes is None  # "max"


def test_a_workload_cgroup_is_read_at_its_pod_when_the_pods_limit_binds(tmp_path):
    """Found from a process (no --cgroup.path): the pod's cgroup where the container has no
    tighter limit of its own (its shm stays charged there after a container restart); the
    container's where it has."""
    [a] = CgroupCollector(tree(tmp_path / "a", SCOPE_A)).collect()
    assert (a.cgroup, a.limit_bytes, a.limit_source, a.oom_kills) == (POD_A, 256 * MiB, "pod", 1)
    [g] = CgroupCollector(tree(tmp_path / "g", SCOPE_G)).collect()
    assert (g.cgroup, g.limit_bytes, g.limit_source) == (SCOPE_G, 384 * MiB, "self")


def test_limit_flag_at_or_above_memtotal_is_no_limit(tmp_path, caplog):
    """The Downward API's limits.memory of a container without a limit is the node's memory:
    not a limit. Below MemTotal the flag counts where it is tighter than the cgroup's."""
    paths = tree(tmp_path, mem_total=8 << 30)
    where = cgroup_dir(paths, SCOPE_A)
    assert usable_limit_flag(paths, 8 << 30) is None and ">= MemTotal" in caplog.text
    huge = CgroupCollector(paths, cgroup_path=where, limit_override=None).collect()[0]
    assert (huge.limit_bytes, huge.limit_source) == (256 * MiB, "pod")
    tight = CgroupCollector(paths, cgroup_path=where, limit_override=200 * MiB).collect()[0]
    assert (tight.limit_bytes, tight.limit_source) == (200 * MiB, "flag")
    loose = CgroupCollector(paths, cgroup_path=where, limit_override=1 << 30).collect()[0]
    assert (loose.limit_bytes, loose.limit_source) == (256 * MiB, "pod")


def test_limit_flag_at_or_above_memtotal_is_said_once(caplog):
    """The exporter checks the flag once for the cgroup collector and the model: one warning."""
    app = App(parse_args(["--memory.limit-bytes", str(1 << 60), "--no-collector.gpu"]))
    try:
        assert app.step.memory_limit is None
        assert caplog.text.count(">= MemTotal") == 1, caplog.text
    finally:
        app.stop(wait=0)


def test_node_mode_pods_on_the_systemd_layout(tmp_path):
    paths = tree(tmp_path)
    listed = CgroupCollector(paths, node_mode=True).pod_cgroups()
    assert [(pod.path, pod.pod_uid) for pod in listed] == sorted(
        [(POD_A, UID_A), (POD_B, UID_B), (POD_G, UID_G)])
    by_uid = {c.pod_uid: c for c in CgroupCollector(paths, node_mode=True).collect()}
    assert (by_uid[UID_A].limit_bytes, by_uid[UID_A].limit_source) == (256 * MiB, "pod")
    assert (by_uid[UID_G].limit_bytes, by_uid[UID_G].limit_source) == (512 * MiB, "pod")
    assert (by_uid[UID_B].limit_bytes, by_uid[UID_B].limit_source) == (16 << 30, "ancestor")
    assert dict(by_uid[UID_A].events)["oom_kill"] == 1


@needs_root
def test_node_mode_acceptance_shape(tmp_path):
    """Node mode with the pod's emptyDir a real 1 GiB tmpfs holding 150 MiB."""
    tree(tmp_path)
    dshm = f"{tmp_path}/var/lib/kubelet/pods/{UID_A}/volumes/kubernetes.io~empty-dir/dshm"
    with mounted_tmpfs("1g", path=dshm, options=",noswap"):
        fallocate(os.path.join(dshm, "psm_kv"), 150 * MiB)
        with Exporter("--mode=node", f"--path.sysfs={tmp_path}/sys", "--no-collector.gpu",
                      "--poll-interval=200ms", "--inventory-interval=500ms", EVERY_FAMILY) as exporter:
            # The pod's mount and cgroup by its pod_uid (and volume): not by their paths.
            pod = {"pod_uid": UID_A}
            s = exporter.wait_for(lambda s: value(s, "shmwatch_mount_effective_size_bytes", volume="dshm", **pod)
                                  is not None)
            assert value(s, "shmwatch_cgroup_memory_limit_bytes", limit_from="pod", **pod) == 256 * MiB
            assert value(s, "shmwatch_shm_oom_projection_ratio", volume="dshm", **pod) > 1
            assert value(s, "shmwatch_mount_effective_size_bytes", volume="dshm", **pod) <= 256 * MiB
            assert value(s, "shmwatch_cgroup_memory_events_total", event="oom_kill", **pod) == 1
            assert value(s, "shmwatch_mount_info", noswap="true", **pod) == 1
            assert not [k for k in s if POD_A in str(k) or dshm in str(k)]


class Estimate(Source):
    """What a sidecar in a private cgroup namespace publishes (the estimate itself runs for real
    in the VM tier: tests/vm/test_cgroup_v2_vm.py)."""
    name = "cgroup"

    def __init__(self, limit):
        self.limit = limit

    def collect(self, run):
        source = "flag" if self.limit else "none"
        return [CgroupMemory(ESTIMATE_CGROUP, 0, 160 * MiB, self.limit, 160 * MiB, 150 * MiB, None, source,
                             estimated=True)]


@needs_root
def test_an_estimate_without_a_limit_has_no_effective_size():
    """An estimate knows no limit (the pod's may be 256 MiB): no effective size rather than the
    whole tmpfs. With the Downward API's limit it has one."""
    with mounted_tmpfs("1g") as shm:
        for limit, expected in ((None, None), (256 * MiB, 96 * MiB)):
            reg, _ = registry_for(ShmMountCollector(Paths()), Estimate(limit), mounts=[shm])
            assert reg.get_sample_value("shmwatch_mount_effective_size_bytes", {"mount": shm}) == expected


def test_node_mode_reads_no_swap_on_a_node_without_swap(tmp_path):
    """SwapTotal 0: no swap series (not read for every pod); with swap, each pod's."""
    for swap_total, expected in ((0, None), (1 << 30, 0)):
        paths = tree(tmp_path / str(swap_total), mem_total=16 << 30)
        with open(paths.proc("meminfo"), "a") as f:
            f.write(f"SwapTotal: {swap_total // 1024} kB\n")
        by_uid = {c.pod_uid: c for c in CgroupCollector(paths, node_mode=True).collect()}
        assert by_uid[UID_A].swap_bytes == expected and by_uid[UID_A].limit_bytes == 256 * MiB


def test_a_container_as_tight_as_its_pod_is_read_at_the_pod(tmp_path):
    """A single-container Guaranteed pod: the container's memory.max equals the pod's. The pod
    binds too, and its cgroup keeps a restarted container's shm: read it there."""
    paths = tree(tmp_path, SCOPE_G)
    with open(os.path.join(cgroup_dir(paths, SCOPE_G), "memory.max"), "w") as f:
        f.write(str(512 * MiB))
    [g] = CgroupCollector(paths).collect()
    assert (g.cgroup, g.limit_bytes, g.limit_source) == (POD_G, 512 * MiB, "pod")
