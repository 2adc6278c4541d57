"""Pure parsers over text, on fixtures and on corrupt input."""
import os
from dataclasses import astuple

from exporter.host.cgroupfs import parse_flat_keyed, parse_limit
from exporter.host.proctable import parse_proc_cgroup
from exporter.collectors.host_memory import parse_meminfo
from exporter.inventory.maps import parse_maps, parse_memfd
from exporter.host.proctable import parse_stat
from exporter.host.mountinfo import MountTable, parse_mountinfo
from exporter.host.paths import Paths
from exporter.collectors.sysv import parse_sysvipc_shm
from tests.conftest import FIXTURES


def fixture(*parts):
    with open(os.path.join(FIXTURES, *parts)) as f:
        return f.read()


def test_meminfo():
    info = parse_meminfo(fixture("proc", "meminfo"))
    assert info["MemTotal"] == 24683568 * 1024
    assert info["MemAvailable"] == 24276128 * 1024
    assert info["Shmem"] == 64 << 20
    assert info["HugePages_Total"] == 0  # no unit: not scaled
    assert "garbage line without colon" not in info


def test_meminfo_corrupt():
    assert parse_meminfo("") == {}
    assert parse_meminfo("MemTotal: lots kB\nShmem:\n:::\n") == {}


def find_mount(entries, path):
    return MountTable(Paths(), entries=entries).find(path)


def test_mountinfo():
    entries = parse_mountinfo(fixture("proc", "self", "mountinfo"))
    shm = find_mount(entries, "/dev/shm")
    assert (shm.mount_point, shm.fstype, shm.source) == ("/dev/shm", "tmpfs", "shm")
    assert "size=65536k" in shm.options.split(",")
    spaced = find_mount(entries, "/mnt/with space")
    assert spaced.fstype == "tmpfs" and spaced.source == "tmpfs"
    # A directory that is not a mount point resolves to the filesystem holding it.
    assert find_mount(entries, "/var/tmp").mount_point == "/"
    assert find_mount(entries, "/dev/shmx").mount_point == "/dev"
    assert len(entries) == 6  # the malformed line is skipped


def test_mountinfo_stacked_mounts_take_the_top_one():
    text = ("24 23 0:26 / /dev/shm rw - tmpfs shm rw,size=65536k\n"
            "99 24 0:99 / /dev/shm rw - tmpfs shm rw,size=16777216k\n")
    assert find_mount(parse_mountinfo(text), "/dev/shm").options.endswith("size=16777216k")


def test_sysvipc():
    segments = parse_sysvipc_shm(fixture("proc", "sysvipc", "shm"))
    assert [(s.shmid, s.size_bytes, s.nattch) for s in segments] == [(3, 8 << 20, 2), (4, 16 << 20, 0)]
    assert segments[0].rss_bytes == 8 << 20
    assert parse_sysvipc_shm("") == []


def test_proc_stat_with_hostile_comm():
    text = "1234 (we ird) (name) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 100"
    stat = parse_stat(text)
    assert stat.comm == "we ird) (name" and stat.flags == 4194560 and stat.start_time == 98765 and stat.ppid == 1


def test_maps_matches_device_and_inode_only():
    tokens = {" 00:1a ": 26}
    text = ("7f0000000000-7f0000400000 rw-s 00000000 00:1a 1234 /dev/shm/nccl-AbCdEf\n"
            "7f0000400000-7f0000600000 rw-s 00200000 00:1a 1235 /nccl-xyz (deleted)\n"
            "7f0000600000-7f0000700000 r--p 00000000 fd:01 1234 /usr/lib/libc.so\n"
            "garbage 00:1a line\n")
    found = [astuple(line) for line in parse_maps(text, tokens)]
    assert found == [(26, 1234, "/dev/shm/nccl-AbCdEf", 4 << 20, "7f0000000000-7f0000400000"),
                     (26, 1235, "/nccl-xyz (deleted)", 4 << 20, "7f0000400000-7f0000600000")]


def test_cgroup_parsers():
    assert parse_proc_cgroup("12:memory:/a/b\n3:cpu,cpuacct:/c\n0::/d\n") == {
        "memory": "/a/b", "cpu": "/c", "cpuacct": "/c", "": "/d"}
    assert parse_limit("max\n") is None
    assert parse_limit("9223372036854771712\n") is None  # v1's "unlimited"
    assert parse_limit("2147483648") == 2 << 30
    assert parse_flat_keyed("anon 1\nfile x\nbad\n\nshmem 3") == {"anon": 1, "shmem": 3}


# --- exact edges the properties do not reach (found surviving mutation testing) ---------

def test_error_messages_name_the_value():
    import pytest
    from exporter.config import parse_duration, parse_size
    with pytest.raises(ValueError, match=r"^invalid duration '0': must be above 0$"):
        parse_duration("0")
    with pytest.raises(ValueError, match=r"^invalid duration '9{400}': too large$"):
        parse_duration("9" * 400)
    with pytest.raises(ValueError, match=r"^invalid size 'lots' \(use e.g. 64Mi, 16Gi, 2g\)$"):
        parse_size("lots")
    with pytest.raises(ValueError, match=r"^sysvipc/shm: unexpected header a b c d e f g h$"):
        parse_sysvipc_shm("a b c d e f g h i j\n")


def test_malformed_lines_in_the_middle_are_skipped():
    assert parse_meminfo("MemTotal: 2 kB\nbroken\nShmem: x kB\nMemFree: 1 kB\n") == {"MemTotal": 2048,
                                                                                       "MemFree": 1024}
    assert parse_meminfo("X: 5 kB: y\n") == {"X": 5}  # the first colon ends the key
    assert parse_proc_cgroup("12:memory:/a\ngarbage\n0::/b\n") == {"memory": "/a", "": "/b"}
    assert parse_proc_cgroup("3:memory:\n") == {"memory": ""}
    text = "key shmid size nattch\n1 2 3 4\n5 6\n7 8 9 10\n"  # only the four columns needed
    assert [(s.key, s.nattch) for s in parse_sysvipc_shm(text)] == [(1, 4), (7, 10)]


def test_v1_unlimited_boundary():
    from exporter.host.cgroupfs import V1_UNLIMITED
    assert parse_limit(str(V1_UNLIMITED)) is None
    assert parse_limit(str(V1_UNLIMITED - 1)) == V1_UNLIMITED - 1


def test_memfd_mappings_on_any_device_no_mount_has():
    text = (
        "7f0000000000-7f0002000000 rw-s 00000000 00:01 12345                      /memfd:mooncake (deleted)\n"
        # a file whose path holds '/memfd:' is not a memfd
        "7f0003000000-7f0004000000 rw-s 00001000 00:05 99                         /tmp/x/memfd:zz (deleted)\n"
        "7f0005000000-7f0005400000 r-xp 00000000 00:0f 777 /memfd:runc_cloned:/proc/self/exe (deleted)\n"
        "7f0006000000-7f0006001000 rw-s 00000000 zz:01 5 /memfd:bad-device (deleted)\n"
        "7f0007000000-7f0007200000 rw-s 00000000 103:02 8 /memfd:hugetlb-on-103 (deleted)\n"
        # a tenant's files at /memfd:x: on a mount (FUSE, 0:2a = 0:42), or not deleted
        "7f0008000000-7f0008200000 rw-s 00000000 00:2a 9 /memfd:x/on-fuse (deleted)\n"
        "7f0009000000-7f0009200000 rw-s 00000000 00:0f 10 /memfd:x/linked"
    )
    assert [astuple(line) for line in parse_memfd(text, {"0:42", "8:1"})] == [
        (os.makedev(0, 1), 12345, "/memfd:mooncake (deleted)", 32 << 20, "7f0000000000-7f0002000000"),
        (os.makedev(0, 15), 777, "/memfd:runc_cloned:/proc/self/exe (deleted)", 4 << 20, "7f0005000000-7f0005400000"),
        (os.makedev(0x103, 2), 8, "/memfd:hugetlb-on-103 (deleted)", 2 << 20, "7f0007000000-7f0007200000"),
    ]
    assert parse_memfd("no memfd here\n", set()) == []
