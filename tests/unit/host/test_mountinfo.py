"""mountinfo.py: the table read from the first readable mountinfo, --path.rootfs stripped,
reread only when the kernel says it changed (POLLPRI, on a real mount and unmount in a
mount namespace of the test's own), and what an unreadable table proves (nothing)."""

import json
import os
import string
import subprocess
import sys
import textwrap

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from exporter.host.mountinfo import MountEntry, MountTable, live_mounts, parse_mountinfo, strip_rootfs
from exporter.host.paths import Paths
from tests.conftest import REPO, needs_root
from tests.helpers import any_text, fixture, paths

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


def test_mountinfo_without_super_options():
    from exporter.host.mountinfo import parse_mountinfo
    (entry,) = parse_mountinfo("1 1 0:1 / /m rw,nosuid - tmpfs shm\n")
    assert (entry.mount_point, entry.options, entry.source) == ("/m", "rw,nosuid,", "shm")


# --- a path that is no mount point any more ---------------------------------------------------
def mountinfo_line(mount_id, point, fstype="tmpfs"):
    return f"{mount_id} 1 0:{mount_id} / {point} rw,nosuid - {fstype} {fstype} rw,size=65536k\n"


def test_a_path_is_gone_only_when_a_readable_table_does_not_list_it(tmp_path):
    paths = Paths(procfs=str(tmp_path))
    table = MountTable(paths)
    table.refresh()  # no mountinfo at all: proves nothing
    assert not table.gone("/dev/shm")
    for pid in ("self", "1"):
        os.makedirs(tmp_path / pid)
        (tmp_path / pid / "mountinfo").write_text("")
    table.refresh()  # an empty table proves nothing either
    assert not table.gone("/dev/shm")
    (tmp_path / "self" / "mountinfo").write_text(
        mountinfo_line(20, "/", "ext4") + mountinfo_line(21, "/dev/shm") + mountinfo_line(22, "/data/my\\040shm"))
    table.refresh()
    assert not table.gone("/dev/shm") and not table.gone("/dev/shm/") and not table.gone("/data/my shm")
    assert table.gone("/dev/shm/sub")  # only a mount above holds it
    assert table.gone("/run/shm")  # the root file system's directory
    assert not table.gone("/")


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


token = st.text(string.ascii_letters + string.digits + "_.=:,", min_size=1, max_size=16)


def mangle(text):
    """The kernel's mangle() for mountinfo: show_mountinfo's " \\t\\n\\\\" set."""
    return "".join("\\%03o" % ord(c) if c in " \t\n\\" else c for c in text)


mount_entries = st.builds(
    lambda mid, parent, major, minor, root, point, opts, optional, fstype, source, super_opts: (
        MountEntry(point, fstype, source, f"{opts},{super_opts}", f"{major}:{minor}", root),
        " ".join([str(mid), str(parent), f"{major}:{minor}", mangle(root), mangle(point), opts, *optional, "-",
                  fstype, mangle(source), super_opts])),
    st.integers(1, 10 ** 6), st.integers(0, 10 ** 6), st.integers(0, 4095), st.integers(0, 2 ** 20), paths, paths,
    token, st.lists(st.sampled_from(["shared:1", "master:7", "propagate_from:3", "unbindable"]), max_size=3),
    st.sampled_from(["tmpfs", "ext4", "overlay", "fuse.sshfs"]), st.one_of(st.just("none"), paths), token)


@given(st.lists(mount_entries, max_size=6))
@example([(MountEntry("/mnt/a\rb", "tmpfs", "shm", "rw,rw", "0:1"), "1 1 0:1 / /mnt/a\rb rw - tmpfs shm rw")])
@example([(MountEntry("/mnt/disk123 ", "tmpfs", "a\\", "rw,", "0:1"), "1 1 0:1 / /mnt/disk123\\040 rw - tmpfs a\\134")])
def test_mountinfo_round_trip(entries):
    text = "\n".join(line for _, line in entries) + "\n"
    assert parse_mountinfo(text) == [entry for entry, _ in entries]


@given(st.lists(mount_entries, max_size=4), any_text)
def test_mountinfo_malformed_lines_are_skipped_not_fatal(entries, garbage):
    good = [line for _, line in entries]
    text = "\n".join(good[:1] + [garbage.replace("\n", " ")] + good[1:])
    got = parse_mountinfo(text)
    # The good lines all come back; the garbage line, if it parses at all, is one more.
    assert len(got) in (len(good), len(good) + 1)
    assert [e for e in got if e in [x for x, _ in entries]] == [x for x, _ in entries]


@given(any_text)
def test_mountinfo_any_text(text):
    for entry in parse_mountinfo(text):
        assert isinstance(entry.mount_point, str)
