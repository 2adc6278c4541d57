"""maps.py: this process's own mappings read back from /proc/self/maps (a file on disk, a
memfd), memfd names, fdinfo's mount ID, and the watched mount IDs per mount namespace, which
leave with the namespace's last process."""

import mmap
import os
from dataclasses import astuple

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from exporter.host.mountinfo import parse_mountinfo
from exporter.host.paths import Paths
from exporter.host.proctable import Process
from exporter.inventory.maps import NO_MNT_ID, WatchedMountIds, dev_token, memfd_name, parse_maps, parse_memfd
from tests.helpers import any_text, paths

PAGE = mmap.PAGESIZE


def own_maps():
    with open("/proc/self/maps") as f:
        return f.read()


def test_a_mapping_of_this_process_is_read_back_by_device_and_inode(tmp_path):
    path = tmp_path / "segment"
    path.write_bytes(b"\0" * 8 * PAGE)
    st = os.stat(path)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 3 * PAGE, offset=2 * PAGE) as mapped:
        mapped[0] = 1
        lines = [line for line in parse_maps(own_maps(), {dev_token(st.st_dev): st.st_dev})
                 if line.inode == st.st_ino]
        assert len(lines) == 1
        [line] = lines
        assert (line.key, line.path, line.extent) == ((st.st_dev, st.st_ino), str(path), 5 * PAGE)
        if os.geteuid() == 0:  # map_files/ names the mapping as map_range does (root only)
            assert os.path.exists(f"/proc/self/map_files/{line.map_range}")


def test_a_memfd_of_this_process_is_found_on_no_mounted_device():
    fd = os.memfd_create("shmwatch-test")
    try:
        os.ftruncate(fd, 4 * PAGE)
        with mmap.mmap(fd, 4 * PAGE) as mapped:
            mapped[0] = 1
            with open("/proc/self/mountinfo") as f:
                mounted = {e.device for e in parse_mountinfo(f.read())}
            found = [m for m in parse_memfd(own_maps(), mounted) if m.inode == os.fstat(fd).st_ino]
            assert [(memfd_name(m.path), m.extent) for m in found] == [("shmwatch-test", 4 * PAGE)]
            dev = os.fstat(fd).st_dev
            on_a_mount = mounted | {f"{os.major(dev)}:{os.minor(dev)}"}
            assert not [m for m in parse_memfd(own_maps(), on_a_mount) if m.inode == os.fstat(fd).st_ino]
    finally:
        os.close(fd)


@pytest.mark.parametrize("path,name", [
    ("/memfd:mooncake (deleted)", "mooncake"),
    ("/memfd: (deleted)", ""),
    ("/memfd:runc_cloned:/proc/self/exe (deleted)", "runc_cloned:/proc/self/exe"),
    ("/memfd:linked", None),  # a file named so, not unlinked: not a memfd
    ("/tmp/memfd:x (deleted)", None),
    ("/dev/shm/nccl-1 (deleted)", None),
])
def test_memfd_name(path, name):
    assert memfd_name(path) == name


def test_fdinfo_names_the_mount_of_an_open_file(tmp_path):
    with open(tmp_path / "f", "w") as f:
        mnt_id = WatchedMountIds.fd_mount(f"/proc/self/fdinfo/{f.fileno()}")
    with open("/proc/self/mountinfo") as table:
        ids = {e.mount_id for e in parse_mountinfo(table.read())}
    assert isinstance(mnt_id, int) and mnt_id in ids


@pytest.mark.parametrize("text,expected", [
    (b"pos:\t0\nflags:\t02\nmnt_id:\t29\nino:\t5\n", 29),
    (b"pos:\t0\nflags:\t02\nmnt_id:  7", 7),
    (b"pos:\t0\nflags:\t02\n", NO_MNT_ID),  # before Linux 3.15: any fd may be on a watched mount
    (b"pos:\t0\nmnt_id:\tx\n", None),
])
def test_fdinfo_texts(tmp_path, text, expected):
    (tmp_path / "fdinfo").write_bytes(text)
    assert WatchedMountIds.fd_mount(str(tmp_path / "fdinfo")) == expected


def test_a_closed_fds_info_is_none(tmp_path):
    assert WatchedMountIds.fd_mount(str(tmp_path / "closed")) is None


SHM_A = "30 25 0:26 / /dev/shm rw - tmpfs shm rw\n"
SHM_B = "77 70 0:41 / /dev/shm rw - tmpfs shm rw\n"
ROOTS = "25 1 8:1 / / rw - ext4 /dev/sda1 rw\n70 1 8:1 / / rw - ext4 /dev/sda1 rw\n"


def namespaces(tmp_path):
    """pids 10 and 11 in one mount namespace (0:26 at /dev/shm), 20 in another (0:41)."""
    for pid, ns, table in ((10, "a", ROOTS + SHM_A), (11, "a", ROOTS + SHM_A), (20, "b", ROOTS + SHM_B)):
        (tmp_path / str(pid) / "ns").mkdir(parents=True)
        os.symlink(f"mnt:[{ns}]", tmp_path / str(pid) / "ns" / "mnt")
        (tmp_path / str(pid) / "mountinfo").write_text(table)
    return Paths(procfs=str(tmp_path))


def procs(*pids):
    return [Process(pid=pid, comm="x", start_time=1, uid=0) for pid in pids]


def test_watched_mount_ids_are_learnt_per_namespace_and_leave_with_its_last_process(tmp_path):
    ids = WatchedMountIds(namespaces(tmp_path))
    watched = {os.makedev(0, 26), os.makedev(0, 41)}
    ids.learn(procs(10, 11, 20), watched)
    assert ids.union == {30, 77} and ids.mounted_ids == {25, 30, 70, 77}
    assert ids.mounted_devs == {"8:1", "0:26", "0:41"} and ids.learned_devs == watched
    ids.forget({10})  # 11 is still in namespace a
    assert ids.union == {30, 77}
    ids.forget({20})  # namespace b's last process
    assert ids.union == {30} and ids.mounted_ids == {25, 30, 70} and ids.mounted_devs == {"8:1", "0:26"}


def test_only_the_watched_devices_ids_and_a_learn_adds_or_starts_again(tmp_path):
    ids = WatchedMountIds(namespaces(tmp_path))
    ids.learn(procs(10), {os.makedev(0, 41)})
    assert ids.union == set()  # namespace a has no mount of 0:41
    ids.learn(procs(20), {os.makedev(0, 41)}, again=False)
    assert ids.union == {77}
    ids.learn(procs(20), {os.makedev(0, 26)})
    assert ids.union == set() and ids.learned_devs == {os.makedev(0, 26)}


def test_a_process_gone_before_its_table_was_read_holds_nothing(tmp_path):
    ids = WatchedMountIds(Paths(procfs=str(tmp_path)))
    assert ids.of(4242, {os.makedev(0, 26)}) == set()  # no ns link, no mountinfo: gone
    ids.forget({4242})
    assert ids.union == set()


def test_maps_matches_device_and_inode_only():
    tokens = {" 00:1a ": 26}
    text = ("7f0000000000-7f0000400000 rw-s 00000000 00:1a 1234 /dev/shm/nccl-AbCdEf\n"
            "7f0000400000-7f0000600000 rw-s 00200000 00:1a 1235 /nccl-xyz (deleted)\n"
            "7f0000600000-7f0000700000 r--p 00000000 fd:01 1234 /usr/lib/libc.so\n"
            "garbage 00:1a line\n")
    found = [astuple(line) for line in parse_maps(text, tokens)]
    assert found == [(26, 1234, "/dev/shm/nccl-AbCdEf", 4 << 20, "7f0000000000-7f0000400000"),
                     (26, 1235, "/nccl-xyz (deleted)", 4 << 20, "7f0000400000-7f0000600000")]


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


# maps escapes only "\n" in a path (seq_file_path(…, "\n")) as \012.
map_paths = st.tuples(paths, st.booleans()).map(
    lambda p: p[0].replace("\n", "\\012") + (" (deleted)" if p[1] else ""))
# A small device space, so that watched and unwatched lines of major 0 (tmpfs) and of real
# disks interleave: the scanner's skip-ahead over unwatched " 00:" tokens is exercised.
devs = st.tuples(st.sampled_from([0, 0, 0x08, 0xfd, 0x103]), st.integers(0, 3))
maps_lines = st.tuples(st.integers(0, 1 << 46), st.integers(1, 1 << 30), st.sampled_from(["rw-s", "r--s", "rw-p"]),
                       st.integers(0, 1 << 40), devs, st.integers(1, 1 << 40), map_paths)


def maps_line(start, length, perms, offset, dev, inode, path):
    head = "%08x-%08x %s %08x %02x:%02x %d " % (start, start + length, perms, offset, dev[0], dev[1], inode)
    return head + " " * max(0, 73 - len(head)) + path


@given(st.lists(maps_lines, max_size=8), st.sets(devs, max_size=3), st.booleans())
@example([(0x7f0000000000, 4096, "rw-s", 0, (0xfd, 1), 7, "/tmp/x 00:1a y (deleted)")], {(0, 0x1a)}, True)
@example([(0x7f0000000000, 4096, "rw-s", 0, (0, 1), 7, "/tmp/x 00:1a y")], {(0, 0x1a)}, True)
@example([(0x7f0000000000, 4096, "rw-s", 0, (0, 1), 7, "/a"), (0x7f0000001000, 4096, "rw-s", 0, (0, 2), 8, "/b"),
          (0x7f0000002000, 4096, "rw-s", 0, (0, 1), 9, "/c"), (0x7f0000003000, 4096, "rw-s", 0, (0, 2), 10, "/d"),
          (0x7f0000004000, 4096, "rw-s", 0, (0xfd, 2), 11, "/e")], {(0, 2), (0xfd, 2)}, False)
def test_maps_finds_exactly_the_watched_lines(lines, watched, final_newline):
    tokens = {" %02x:%02x " % d: (d[0] << 8) | d[1] for d in watched}
    text = "\n".join(maps_line(*line) for line in lines) + ("\n" if final_newline else "")
    want = [((d[0] << 8) | d[1], inode, path, offset + length, f"{start:x}-{start + length:x}")
            for start, length, _, offset, d, inode, path in lines if d in watched]
    assert sorted(astuple(line) for line in parse_maps(text, tokens)) == sorted(want)


@given(any_text, st.sets(devs, max_size=3))
def test_maps_any_text(text, watched):
    for line in parse_maps(text, {" %02x:%02x " % d: d[1] for d in watched}):
        assert line.extent >= 0 and "-" in line.map_range


def test_dev_token_matches_maps():
    assert dev_token(os.makedev(0, 0x1a)) == " 00:1a "
    assert dev_token(os.makedev(0x103, 0x1ff)) == " 103:1ff "
