"""Small exact cases for the pure helpers that the parser properties do not pin: the
catalogue's lookups, the derived values of the collector dataclasses, mount lookup.
Part of the mutation-testing selection (pyproject.toml [tool.mutmut])."""
import pytest

from exporter.model.types import MountUsage, SysvSegment, SysvShm
from exporter.model.catalogue import BY_NAME, CATALOGUE, NODE_MOUNT_LABELS, lookup, node_labels
from exporter.host.mountinfo import MountEntry, MountTable
from exporter.host.paths import Paths


def test_lookup_names_the_catalogue():
    assert lookup("shmwatch_mount_usage_ratio").unit == "ratio"
    with pytest.raises(KeyError, match="shmwatch_nope is not in exporter/model/catalogue.py"):
        lookup("shmwatch_nope")


def test_node_labels():
    assert node_labels(lookup("shmwatch_mount_size_bytes")) == NODE_MOUNT_LABELS == ("pod_uid", "volume",
                                                                                       "container_id")
    assert node_labels(lookup("shmwatch_cgroup_memory_usage_bytes")) == ("pod_uid",)
    assert node_labels(lookup("shmwatch_process_shm_bytes")) == NODE_MOUNT_LABELS + ("process_pod_uid",)
    assert node_labels(lookup("shmwatch_build_info")) == ()
    assert node_labels(lookup("shmwatch_sysv_segments")) == ("ipc_namespace", "pod_uid", "container_id")
    assert node_labels(lookup("shmwatch_process_memfd_bytes")) == ("process_pod_uid",)
    # A metric with both a mount and a cgroup label is labelled as a mount's.
    oom = lookup("shmwatch_shm_oom_projection_ratio")
    assert {"mount", "cgroup"} <= set(oom.labels) and node_labels(oom) == NODE_MOUNT_LABELS


def test_catalogue_is_consistent():
    assert len(BY_NAME) == len(CATALOGUE)
    for m in CATALOGUE:
        assert m.type in ("gauge", "counter") and (m.type == "counter") == m.name.endswith("_total"), m.name
        assert m.help.strip(), m.name


def test_usage_ratio():
    assert MountUsage("/m", "tmpfs", "s", True, size_bytes=200, used_bytes=50).usage_ratio == 0.25
    assert MountUsage("/m", "tmpfs", "s", True, size_bytes=0, used_bytes=50).usage_ratio == 0.0


def test_sysv_totals():
    shm = SysvShm([SysvSegment(1, 1, 100, 0, 9, 40, orphan=True), SysvSegment(2, 2, 300, 2, 9, 300),
                   SysvSegment(3, 3, 5, 0, 9, 0)], None, None, None)
    # Only what the collector found unattached with its creator and last user gone counts.
    assert (shm.total_bytes, shm.resident_bytes, shm.orphans) == (405, 340, 1)


def find_mount(entries, path):
    return MountTable(Paths(), entries=entries).find(path)


def test_find_mount_longest_prefix_on_component_boundaries():
    entries = [MountEntry("/", "ext4", "/dev/sda", "rw,"), MountEntry("/dev", "devtmpfs", "udev", "rw,"),
               MountEntry("/dev/shm", "tmpfs", "shm", "rw,size=64k")]
    assert find_mount(entries, "/dev/shm").fstype == "tmpfs"
    assert find_mount(entries, "/dev/shm/").fstype == "tmpfs"
    assert find_mount(entries, "/dev/shm/sub/dir").fstype == "tmpfs"
    assert find_mount(entries, "/dev/shmx").mount_point == "/dev"
    assert find_mount(entries, "/var").mount_point == "/"
    assert find_mount([], "/x") is None
    # Trailing spaces and capital X are part of a name: only "/" is stripped.
    odd = entries + [MountEntry("/mnt/x ", "tmpfs", "a", "rw,"), MountEntry("/mnt/dataX", "tmpfs", "b", "rw,")]
    assert find_mount(odd, "/mnt/x ").source == "a"
    assert find_mount(odd, "/mnt/x /seg").source == "a"
    assert find_mount(odd, "/mnt/dataX").source == "b"
    assert find_mount(odd, "/mnt/dataX/seg").source == "b"
    assert find_mount(entries[1:], "/var") is None


def test_clean_exact_forms():
    from exporter.exposition.metrics import MAX_LABEL_CHARS, clean_label as clean
    assert clean("psm_\udcff\udcfe") == "psm_\ufffd\ufffd"  # undecodable bytes from os.scandir
    assert clean(b"psm_\xff") == "psm_\ufffd"
    assert clean("esc\x1b[31m\x7f\x9b") == "esc\\x1b[31m\\x7f\\x9b"  # lower-case hex, C0, DEL and C1
    assert clean("a\nb") == "a\\x0ab"
    assert clean("x" * MAX_LABEL_CHARS) == "x" * MAX_LABEL_CHARS  # at the limit: whole
    assert clean("x" * (MAX_LABEL_CHARS + 1)) == "x" * (MAX_LABEL_CHARS - 1) + "\u2026"
    assert clean("abcdef", 4) == "abc\u2026"


def test_mountinfo_without_super_options():
    from exporter.host.mountinfo import parse_mountinfo
    (entry,) = parse_mountinfo("1 1 0:1 / /m rw,nosuid - tmpfs shm\n")
    assert (entry.mount_point, entry.options, entry.source) == ("/m", "rw,nosuid,", "shm")


def test_class_cache_remembers_and_is_bounded():
    from exporter.model.classes import classify
    classify.cache_clear()
    assert classify("nccl-remember") == "nccl"
    assert classify("nccl-remember") == "nccl"  # names repeat between inventories
    assert classify.cache_info().hits == 1  # read from the cache, not re-matched
    classify.cache_clear()
    bound = classify.cache_info().maxsize
    assert bound
    for n in range(bound + 1):
        classify(f"psm_{n:08x}")
        assert classify.cache_info().currsize <= bound
    classify.cache_clear()


def test_pod_uid_in_cgroup_both_drivers():
    from exporter.host.kube import pod_uid_in_cgroup
    uid = "0f1e2d3c-aaaa-bbbb-cccc-000000000001"
    assert pod_uid_in_cgroup(f"/kubepods/burstable/pod{uid}/cri-containerd-abc.scope") == uid
    systemd = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + uid.replace("-", "_") + ".slice"
    assert pod_uid_in_cgroup(systemd) == uid  # underscores back to dashes
    text = f"12:memory:/kubepods/pod{uid}/c1\n11:cpu:/kubepods/pod{uid}/c1\n0::/\n"
    assert pod_uid_in_cgroup(text) == uid  # /proc/<pid>/cgroup, several lines
    assert pod_uid_in_cgroup("/system.slice/docker-abc.scope") == ""
    assert pod_uid_in_cgroup("/kubepods/pod0F1E2D3C-AAAA-BBBB-CCCC-000000000001") == ""  # not a kubelet UID
    assert pod_uid_in_cgroup(f"/kubepods/pod{uid[:-1]}") == ""  # one hex digit short
    assert pod_uid_in_cgroup(f"/kubepods/{uid}") == ""  # no "pod" prefix


def test_parse_hidepid_old_and_new_spellings():
    from exporter.host.proctable import parse_hidepid
    assert parse_hidepid("rw,nosuid,nodev,noexec,relatime") == "off"
    assert parse_hidepid("rw,hidepid=0") == "off"
    assert parse_hidepid("rw,hidepid=1,gid=5") == "noaccess"
    assert parse_hidepid("rw,nosuid,hidepid=2") == "invisible"
    assert parse_hidepid("hidepid=4") == "ptraceable"
    assert parse_hidepid("rw,hidepid=invisible") == "invisible"
    assert parse_hidepid("rw,hidepid=noaccess") == "noaccess"
    assert parse_hidepid("rw,hidepid=ptraceable,subset=pid") == "ptraceable"
    assert parse_hidepid("rw,xhidepid=2") == "off"  # an option must start with the name
    assert parse_hidepid("") == "off"


def test_a_cgroup_path_may_hold_colons():
    from exporter.host.proctable import parse_proc_cgroup
    assert parse_proc_cgroup("0::/kubepods/a:b\n5:memory:/docker/x:y:z\n") == {"": "/kubepods/a:b",
                                                                             "memory": "/docker/x:y:z"}


def test_pids_wrapped_only_when_a_known_pid_may_be_another_process():
    from exporter.host.proctable import PidCounts, pids_wrapped

    def counts(last_pid: int, forks: int, pid_max: int) -> PidCounts:
        return PidCounts(last_pid=last_pid, forks=forks, pid_max=pid_max)

    pid_max = 32768
    assert pids_wrapped(counts(500, 9000, pid_max), None)  # cannot tell: assume they did
    assert not pids_wrapped(None, counts(500, 9000, pid_max))  # the first reading
    assert not pids_wrapped(counts(500, 9000, pid_max), counts(900, 9400, pid_max))
    assert pids_wrapped(counts(500, 9000, pid_max), counts(400, 9100, pid_max))  # ns_last_pid went down
    # As many forks as there are pids above the reserved ones: every pid may be new.
    assert pids_wrapped(counts(500, 9000, pid_max), counts(600, 9000 + pid_max - 300, pid_max))
    assert not pids_wrapped(counts(500, 9000, pid_max), counts(600, 9000 + pid_max - 301, pid_max))
