"""exposition/metrics.py: labels that say what a series is about once, and processes by name."""

from exporter.exposition.metrics import cgroup_label, largest_by_name, mount_label, pods_twice
from exporter.model.step import MountView

EMPTYDIR = "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/dshm"


def view(mount, labels):
    return MountView(mount, labels, None, None, None, None, None, None, None, None)


def test_a_mount_is_its_path_or_its_pod_and_volume():
    assert mount_label(view("/dev/shm", {})) == "/dev/shm"  # a sidecar's
    none = {"pod_uid": "", "volume": "", "container_id": ""}
    assert mount_label(view("/dev/shm", none)) == "/dev/shm"  # node mode, the host's
    assert mount_label(view(EMPTYDIR, {**none, "pod_uid": "u1", "volume": "dshm"})) == ""
    assert mount_label(view("/run/containerd/x/shm", {**none, "container_id": "abc"})) == ""


def test_a_pods_cgroup_is_its_pod_in_node_mode():
    assert cgroup_label("/kubepods/burstable/podu1", "u1", node_mode=True) == ""
    assert cgroup_label("/kubepods/burstable/podu1", "u1", node_mode=False) == "/kubepods/burstable/podu1"
    assert cgroup_label("/system.slice", "", node_mode=True) == "/system.slice"
    # Two cgroups of one pod in a family (a kill counted under the path the kernel named,
    # beside the live one): the paths tell the series apart.
    assert cgroup_label("/kubepods/burstable/podu1", "u1", True, frozenset({"u1"})) == "/kubepods/burstable/podu1"
    assert cgroup_label("/kubepods/burstable/podu2", "u2", True, frozenset({"u1"})) == ""
    assert pods_twice(["u1", "u2", "u1", "", ""]) == {"u1"}
    assert cgroup_label("/x\n" + "y" * 300, "", node_mode=False) == "/x\\x0a" + "y" * 249 + "\u2026"


def test_processes_by_name_and_pod_the_largest_of_each():
    held = [(1, 10), (2, 30), (3, 20), (4, 5), (5, 7)]
    comms = {1: "python3", 2: "python3", 3: "vllm", 4: "python3", 5: "bad\x1bname"}
    pods = {1: "u1", 2: "u1", 3: "u1", 4: "u2"}
    assert largest_by_name(held, comms, pods) == {
        ("python3", "u1"): 30, ("vllm", "u1"): 20, ("python3", "u2"): 5, ("bad\\x1bname", ""): 7}
    assert largest_by_name([(9, 1)], {}, {}) == {("unknown", ""): 1}
