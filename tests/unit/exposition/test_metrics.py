"""exposition/metrics.py: labels that say what a series is about once, and processes by name;
the mounts whose segments are rendered; a figure not known yet is absent."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exporter.exposition.metrics import (
    MAX_LABEL_CHARS,
    ModelCollector,
    cgroup_label,
    largest_by_name,
    listed_mounts,
    mount_label,
    pods_twice,
    required,
)
from exporter.exposition.metrics import clean_label as clean
from exporter.exposition.render import Families
from exporter.model.state import MountStates
from exporter.model.step import Model, MountView
from exporter.model.types import CgroupMemory, MountInventory, MountUsage

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


def model_of(mounts):
    states = MountStates(peaks={}, max_used={}, event_rows={}, inotify={}, overflows={})
    return Model(node_mode=False, statuses=[], mounts=mounts, inventory=None, cgroups=[], host_memory=None, sysv=[],
                 gpu=None, process_samples=[], states=states)


def test_segments_are_rendered_for_the_mounts_whose_inventory_was_read():
    summary, inventory = object(), MountInventory("/a")
    read = MountView("/a", {}, None, None, None, None, inventory, summary, None, None)
    failed = view("/b", {})  # no inventory, no summary
    listed = listed_mounts(model_of([read, failed]))
    assert [(m.view, m.summary, m.inventory) for m in listed] == [(read, summary, inventory)]
    with pytest.raises(ValueError):  # a segments run that succeeded made one: its render fails, logged
        required(None)


def test_a_peak_not_known_yet_is_absent_not_zero():
    out = Families()
    usage = MountUsage("/dev/shm", "tmpfs", "shm", True, size_bytes=100, used_bytes=40, available_bytes=60)
    ModelCollector._one_mount_usage(out, "/dev/shm", usage, None, 40, None)
    assert "shmwatch_mount_peak_used_bytes" not in out.parts
    assert out.parts["shmwatch_mount_max_used_bytes"] == ['shmwatch_mount_max_used_bytes{mount="/dev/shm"} 40.0\n']
    assert out.parts["shmwatch_mount_used_bytes"] == ['shmwatch_mount_used_bytes{mount="/dev/shm"} 40.0\n']


def test_a_projection_without_a_cgroup_has_no_cgroup_label():
    pod = CgroupMemory(cgroup="/kubepods/burstable/podu1", version=1, pod_uid="u1", usage_bytes=0, limit_bytes=None,
                       working_set_bytes=0, shmem_bytes=None, oom_kills=0, limit_source="cgroup")
    assert ModelCollector._derived_cgroup(None, node_mode=True) == ""
    assert ModelCollector._derived_cgroup(pod, node_mode=True) == ""
    assert ModelCollector._derived_cgroup(pod, node_mode=False) == "/kubepods/burstable/podu1"


def test_clean_exact_forms():
    from exporter.exposition.metrics import MAX_LABEL_CHARS
    from exporter.exposition.metrics import clean_label as clean
    assert clean("psm_\udcff\udcfe") == "psm_\ufffd\ufffd"  # undecodable bytes from os.scandir
    assert clean(b"psm_\xff") == "psm_\ufffd"
    assert clean("esc\x1b[31m\x7f\x9b") == "esc\\x1b[31m\\x7f\\x9b"  # lower-case hex, C0, DEL and C1
    assert clean("a\nb") == "a\\x0ab"
    assert clean("x" * MAX_LABEL_CHARS) == "x" * MAX_LABEL_CHARS  # at the limit: whole
    assert clean("x" * (MAX_LABEL_CHARS + 1)) == "x" * (MAX_LABEL_CHARS - 1) + "\u2026"
    assert clean("abcdef", 4) == "abc\u2026"


# What clean() is given: names from os.scandir or /proc, str with undecodable bytes as
# surrogateescape's lone surrogates (U+DC80..U+DCFF, never another lone surrogate), or bytes.
names = st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=300),
                  st.binary(max_size=300).map(lambda b: b.decode("utf-8", "surrogateescape")))


@given(st.one_of(names, st.binary(max_size=400)), st.integers(2, 300))
def test_clean_labels(value, limit):
    out = clean(value, limit)
    assert len(out) <= limit
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", out)
    out.encode("utf-8")  # valid UTF-8: no lone surrogates left
    assert clean(out, limit) == out
    if isinstance(value, str) and value.isprintable() and len(value) <= limit and value == clean(value, limit):
        assert out == value


def test_clean_default_limit():
    assert len(clean("x" * 1000)) == MAX_LABEL_CHARS
