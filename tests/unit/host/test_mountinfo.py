"""mountinfo.py: the table read from the first readable mountinfo, --path.rootfs stripped,
reread only when the kernel says it changed (POLLPRI, on a real mount and unmount in a
mount namespace of the test's own), and what an unreadable table proves (nothing)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from exporter.host.mountinfo import MountEntry, MountTable, live_mounts, parse_mountinfo, strip_rootfs
from exporter.host.paths import Paths
from tests.conftest import REPO, needs_root

SHM = "30 25 0:26 / /dev/shm rw,nosuid,nodev - tmpfs shm rw,size=65536k\n"
ROOT = "25 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"


def proc_tree(tmp_path, tables):
    """A procfs with `tables`: pid -> its mountinfo text."""
    for pid, text in tables.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "mountinfo").write_text(text)
    return Paths(procfs=str(tmp_path))


def entry(point, fstype="tmpfs"):
    return MountEntry(point, fstype, "x", "rw,")


def test_fields_are_unescaped_and_the_id_is_not_part_of_the_mount():
    [e] = parse_mountinfo("41 30 0:52 /var/lib\\040a /mnt/my\\011dir rw - tmpfs src\\134x rw\n")
    assert (e.mount_point, e.root, e.source, e.device, e.mount_id) == ("/mnt/my\tdir", "/var/lib a", "src\\x", "0:52", 41)
    [same] = parse_mountinfo("99 30 0:52 /var/lib\\040a /mnt/my\\011dir rw - tmpfs src\\134x rw\n")
    assert same == e  # IDs are per boot: the same mount under another ID is equal


def test_rootfs_is_stripped_from_our_own_table_and_what_is_outside_dropped():
    ours = [entry("/"), entry("/proc", "proc"), entry("/host", "ext4"), entry("/host/dev/shm"),
            entry("/hostile")]
    assert [e.mount_point for e in strip_rootfs(ours, "/host")] == ["/", "/dev/shm"]
    assert [e.mount_point for e in strip_rootfs(ours, "/host/")] == ["/", "/dev/shm"]
    # the host's own table (pid 1's, read through /host/proc) does not list /host: kept whole
    host = [entry("/", "ext4"), entry("/dev/shm")]
    assert strip_rootfs(host, "/host") == host
    assert strip_rootfs(ours, "/") == ours and strip_rootfs(ours, "") == ours


def test_the_order_tables_are_read_in_follows_rootfs():
    assert MountTable(Paths()).order == ("self", "1")  # a sidecar: its own mounts
    assert MountTable(Paths(rootfs="/host")).order == ("1", "self")  # a DaemonSet: the host's


def test_the_first_readable_table_is_read_and_a_regular_file_every_time(tmp_path):
    table = MountTable(proc_tree(tmp_path, {"1": ROOT + SHM}))  # no self/mountinfo
    assert [e.mount_point for e in table.read()] == ["/", "/dev/shm"]
    assert table.read() is not None  # a file, not the kernel's: no POLLPRI to wait for
    assert table.refresh() and table.mounted_at("/dev/shm/").fstype == "tmpfs"


def test_no_readable_table_is_an_error_naming_each_file(tmp_path):
    table = MountTable(Paths(procfs=str(tmp_path)))
    with pytest.raises(OSError) as raised:
        table.read()
    assert str(raised.value) == (f"{tmp_path}/self/mountinfo: No such file or directory; "
                                 f"{tmp_path}/1/mountinfo: No such file or directory")


def test_an_unreadable_table_proves_no_mount_gone(tmp_path):
    paths = proc_tree(tmp_path, {"self": ROOT + SHM})
    table = MountTable(paths)
    assert table.refresh() and not table.gone("/dev/shm") and table.gone("/mnt/other")
    os.remove(paths.proc("self", "mountinfo"))
    assert table.refresh()  # changed: now nothing is known
    assert table.find("/dev/shm") is None and not table.gone("/dev/shm") and not table.gone("/mnt/other")


def test_a_path_below_a_mount_is_found_in_it_but_is_not_its_mount_point(tmp_path):
    table = MountTable(Paths(), entries=[entry("/", "ext4"), entry("/dev/shm")])
    assert table.find("/dev/shm/sub/seg").mount_point == "/dev/shm"
    assert table.mounted_at("/dev/shm/sub") is None and table.mounted_at("/dev/shm//") is not None
    assert table.find("relative/path") is None


def test_live_mounts_passes_a_callable_and_fixes_a_list():
    names = ["/dev/shm"]
    fixed = live_mounts(names)
    names.append("/mnt/later")
    assert fixed() == ["/dev/shm"]
    discovered = ["/a"]
    assert live_mounts(lambda: discovered)() is discovered


KERNEL_TABLE = textwrap.dedent("""
    import json, os, subprocess, tempfile
    from exporter.host.mountinfo import MountTable
    from exporter.host.paths import Paths
    table, point, seen = MountTable(Paths()), tempfile.mkdtemp(), {}
    seen["first"], seen["unchanged"] = table.refresh(), table.refresh()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", point], check=True)
    seen["mounted"], seen["fstype"] = table.refresh(), table.mounted_at(point).fstype
    seen["still"] = table.refresh()
    subprocess.run(["umount", point], check=True)
    seen["unmounted"], seen["gone"] = table.refresh(), table.gone(point)
    os.rmdir(point)
    print(json.dumps(seen))
""")


@needs_root
def test_the_kernels_table_is_reread_only_when_a_mount_changed_it():
    # In a mount namespace of its own: the other mounts on this machine do not reach it.
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", KERNEL_TABLE],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"first": True, "unchanged": False, "mounted": True, "fstype": "tmpfs",
                                         "still": False, "unmounted": True, "gone": True}
