"""The shm budget: what a mount can really hold once --shm.size-limit and the memory limit
are counted, each bound tested on both sides so that dropping or double-counting one fails.

The unit cases pin the formulas (exporter/model/summary.py); the end-to-end cases check that the
flag reaches them, through /metrics and through `shmwatch check`.
"""
import json
import subprocess
import sys

import pytest

from exporter.model.types import CgroupMemory, MountUsage
from exporter.model.summary import cgroups_by_pod, shm_budget
from exporter.collectors.cgroup import CgroupCollector
from exporter.host.kube import pod_uid_of_mount
from exporter.host.paths import Paths
from tests.conftest import REPO, Exporter, mounted_tmpfs, needs_root, prerequisite_missing, remove_cgroup, value

GiB, MiB = 1 << 30, 1 << 20


def mount(size, used):
    return MountUsage("/dev/shm", "tmpfs", "shm", True, size_bytes=size, used_bytes=used, available_bytes=size - used)


def cgroup(limit, working_set, uid=""):
    return CgroupMemory("/kubepods/pod", 2, working_set, limit, working_set, None, 0, "cgroup", uid)


def test_room_counts_shm_once():
    # 16 GiB tmpfs holding 1 GiB, in a pod at 3 GiB of an 8 GiB limit: the 1 GiB of shm is part
    # of the 3 GiB, so the rest of the pod uses 2 GiB and leaves 6 GiB for shm, not 5.
    b = shm_budget(mount(16 * GiB, GiB), cgroup(8 * GiB, 3 * GiB))
    assert b.room_bytes == 6 * GiB
    assert b.effective_bytes == 6 * GiB
    assert b.fillable_bytes == 16 * GiB
    assert b.projection == pytest.approx((2 + 16) / 8)


def test_effective_is_bounded_by_the_tmpfs_when_the_limit_is_generous():
    b = shm_budget(mount(4 * GiB, GiB), cgroup(64 * GiB, 3 * GiB))
    assert (b.effective_bytes, b.room_bytes) == (4 * GiB, 62 * GiB)
    assert b.projection == pytest.approx((2 + 4) / 64)


def test_size_limit_below_the_tmpfs_binds():
    # Older kubelets leave the tmpfs at half of node RAM and enforce sizeLimit by eviction.
    b = shm_budget(mount(64 * GiB, 0), cgroup(128 * GiB, GiB), size_limit=16 * GiB)
    assert (b.fillable_bytes, b.effective_bytes) == (16 * GiB, 16 * GiB)
    assert b.projection == pytest.approx((1 + 16) / 128)
    # A sizeLimit above the tmpfs does not enlarge it.
    assert shm_budget(mount(4 * GiB, 0), None, size_limit=16 * GiB).effective_bytes == 4 * GiB


def test_working_set_below_shm_used_clamps_at_zero():
    # Pages can be charged elsewhere (another cgroup touched them first): never negative.
    b = shm_budget(mount(8 * GiB, 4 * GiB), cgroup(2 * GiB, GiB))
    assert b.room_bytes == 2 * GiB and b.effective_bytes == 2 * GiB
    assert b.projection == pytest.approx(8 / 2)
    full = shm_budget(mount(8 * GiB, 0), cgroup(GiB, 3 * GiB))
    assert full.room_bytes == 0 and full.effective_bytes == 0


def test_without_a_cgroup_the_flag_limit_alone_bounds_it():
    b = shm_budget(mount(16 * GiB, GiB), None, memory_limit=4 * GiB)
    assert (b.fillable_bytes, b.effective_bytes, b.room_bytes, b.projection) == (16 * GiB, 4 * GiB, 4 * GiB, None)
    b = shm_budget(mount(2 * GiB, GiB), None, memory_limit=4 * GiB)
    assert b.effective_bytes == 2 * GiB
    # An unlimited cgroup: the tmpfs alone, no projection.
    b = shm_budget(mount(2 * GiB, GiB), cgroup(None, GiB), memory_limit=GiB)
    assert (b.fillable_bytes, b.effective_bytes, b.room_bytes, b.projection) == (2 * GiB, 2 * GiB, None, None)
    assert shm_budget(mount(2 * GiB, 0), None).effective_bytes == 2 * GiB


UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def test_node_mode_charges_a_mount_to_its_pod():
    mount_path = f"/var/lib/kubelet/pods/{UID}/volumes/kubernetes.io~empty-dir/dshm"
    assert pod_uid_of_mount(mount_path) == UID
    assert pod_uid_of_mount("/dev/shm") == ""
    mine, other = cgroup(GiB, 0, UID), cgroup(2 * GiB, 0, "ffffffff-4b5a-6978-8796-a5b4c3d2e1f0")
    assert cgroups_by_pod([other, mine]).get(pod_uid_of_mount(mount_path)) is mine
    assert cgroups_by_pod([other, mine]).get(pod_uid_of_mount("/dev/shm")) is None
    sidecar, second = cgroup(GiB, 0), cgroup(2 * GiB, 0)
    assert cgroups_by_pod([sidecar, second]).get(pod_uid_of_mount("/dev/shm")) is sidecar  # the first watched cgroup


def test_v1_parent_limit_binds(tmp_path):
    """A v1 container with no limit of its own inside a pod with one: memory.stat's
    hierarchical_memory_limit is the limit that OOM-kills it."""
    leaf = tmp_path / "sys" / "fs" / "cgroup" / "memory" / "kubepods" / "pod1" / "c"
    leaf.mkdir(parents=True)
    (leaf / "memory.usage_in_bytes").write_text(f"{100 * MiB}\n")
    (leaf / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited here
    (leaf / "memory.stat").write_text(f"total_inactive_file {10 * MiB}\nhierarchical_memory_limit {512 * MiB}\n")
    paths = Paths(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys"))
    [result] = CgroupCollector(paths, cgroup_path="/kubepods/pod1/c").collect()
    assert (result.version, result.limit_bytes, result.limit_source) == (1, 512 * MiB, "ancestor")
    assert result.working_set_bytes == 90 * MiB


@needs_root
def test_v1_limit_is_the_tightest_up_the_tree_on_a_real_kernel():
    """memory.stat's hierarchical_memory_limit is the kernel's min over the cgroup and its
    ancestors, so the collector reads it instead of memory.limit_in_bytes: the parent's
    limit when the child has none, the child's own when tighter."""
    import os
    import uuid

    root = "/sys/fs/cgroup/memory"
    if not os.path.exists(os.path.join(root, "cgroup.procs")):
        prerequisite_missing("needs the cgroup v1 memory controller")
    parent = f"shmwatch-test-{uuid.uuid4().hex[:8]}"
    child = os.path.join(root, parent, "c")
    os.makedirs(child)
    try:
        with open(os.path.join(root, parent, "memory.limit_in_bytes"), "w") as f:
            f.write(str(512 * MiB))
        paths = Paths()
        assert CgroupCollector(paths, cgroup_path=f"/{parent}/c").collect()[0].limit_bytes == 512 * MiB
        with open(os.path.join(child, "memory.limit_in_bytes"), "w") as f:
            f.write(str(256 * MiB))
        assert CgroupCollector(paths, cgroup_path=f"/{parent}/c").collect()[0].limit_bytes == 256 * MiB
    finally:
        remove_cgroup(child)
        remove_cgroup(os.path.join(root, parent))


@needs_root
def test_size_limit_flag_reaches_metrics_and_check():
    """--shm.size-limit smaller than the tmpfs (the golden run sets it equal) must show."""
    with mounted_tmpfs("64m") as shm:
        with Exporter(f"--shm.mount={shm}", "--no-collector.gpu", "--no-collector.cgroup",
                      "--shm.size-limit=24Mi") as exporter:
            s = exporter.scrape()
        # The exporter's flags: without the cgroup collector no memory limit to wait for (a
        # limit that could not be read leaves the effective size unknown: null).
        result = subprocess.run([sys.executable, "-m", "exporter", "check", "--no-collector.gpu",
                                 "--no-collector.cgroup", f"--shm.mount={shm}", "--shm.size-limit=24Mi", "--output", "json"],
                                cwd=REPO, capture_output=True, text=True, timeout=60)
    assert value(s, "shmwatch_mount_size_bytes", mount=shm) == 64 * MiB
    assert value(s, "shmwatch_mount_effective_size_bytes", mount=shm) == 24 * MiB
    doc = json.loads(result.stdout)
    entry = next(m for m in doc["shm"] if m["mount"] == shm)
    assert (entry["size_bytes"], entry["effective_size_bytes"]) == (64 * MiB, 24 * MiB), result.stderr
