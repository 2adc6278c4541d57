"""Exact cases for decisions that an audit's planted bugs slipped past: a segment's state when
its mount's device changed or it was doubted, a degraded mount's totals, the packed row's
fields at their widths with real mtimes, ties between equal cgroup limits, a path that is no
longer a mount point, a mount polled gone or as another instance. Pure and fast: part of the
mutation-testing selection (pyproject.toml [tool.mutmut])."""
import os
from collections import Counter

import pytest

from exporter.collectors.cgroup import CgroupAt, CgroupCollector
from exporter.host.cgroupfs import BindingLimit, effective_limit
from exporter.inventory.holdings import unheld_state
from exporter.host.mountinfo import MountTable
from exporter.host.paths import Paths
from exporter.inventory.walk import Listing, _File, _update
from exporter.model.classes import CLASS_NAMES
from exporter.model.state import StateStore
from exporter.model.summary import summarise
from exporter.model.types import ClassTotals, MountInstance, MountInventory, MountUsage, Row

KNOWN = Row.KNOWN


def pack(cls, flags, ino, mtime, blocks, size):
    """A row of these fields (`flags`: KNOWN or 0), by Row.pack."""
    return Row.pack(class_index=cls, inode=ino, mtime=mtime, blocks=blocks, apparent_bytes=size,
                    known=bool(flags & KNOWN))


def unpack(row):
    """(class index, inode, mtime, allocated bytes, apparent bytes), by Row's accessors."""
    return Row.class_index(row), Row.inode(row), Row.mtime(row), Row.allocated_bytes(row), Row.apparent_bytes(row)


def totals(t):
    return t.count, t.allocated_bytes, t.apparent_bytes


KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# --- a listed file nobody holds ------------------------------------------------------------
DEV, INO = 41, 7
KEY = (DEV, INO)
KNOWN_ROW = pack(0, KNOWN, INO, 0, 8, 4096)  # listed before the last full scan read /proc


def test_a_known_flag_from_another_device_is_not_known():
    """The mount's device changed since the last full scan (a pod deleted, its path mounted
    again: tmpfs numbers inodes from 1, so the same inode is another file): the row's known
    flag is not the full scan's word. A quick run takes the file as its creator's, a refresh
    leaves it unverified; on the same device it is an orphan."""
    for quick, other_device in ((True, "linked"), (False, "unverified")):
        assert unheld_state("a", KNOWN_ROW, KEY, DEV, (), set(), True, quick, False) == "orphan"
        assert unheld_state("a", KNOWN_ROW, KEY, DEV + 1, (), set(), True, quick, False) == other_device
        assert unheld_state("a", KNOWN_ROW, KEY, None, (), set(), True, quick, False) == other_device
    new_row = pack(0, 0, INO, 0, 8, 4096)
    assert unheld_state("a", new_row, KEY, DEV, (), set(), True, True, False) == "linked"
    # A full scan this run listed it before reading /proc: known whatever the flag says.
    assert unheld_state("a", new_row, KEY, DEV + 1, (), set(), True, False, True) == "orphan"
    assert unheld_state("a", new_row, KEY, DEV + 1, (), set(), False, False, True) == "unverified"


def test_a_doubted_or_once_held_file_is_leaked_only_on_a_full_scans_word():
    """Changed since its pod was read (`doubted`: those names, or None for any), or held at
    the last full scan: unverified until a full scan; otherwise a known unheld file is an
    orphan. The held set is keyed by (device, inode): the same inode on another device is
    another file."""
    def state(name, doubted=(), held=frozenset(), settled=False, complete=True):
        return unheld_state(name, KNOWN_ROW, KEY, DEV, doubted, held, complete, False, settled)

    assert state("a") == "orphan"
    assert state("a", doubted=None) == "unverified"
    assert state("a", doubted={"a"}) == "unverified"
    assert state("b", doubted={"a"}) == "orphan"
    assert state("a", held={KEY}) == "unverified"
    assert state("a", held={(DEV + 1, INO), (DEV, INO + 1)}) == "orphan"
    for doubted, held in ((None, set()), ({"a"}, set()), ((), {KEY})):
        assert state("a", doubted, held, settled=True) == "orphan"
        assert state("a", doubted, held, settled=True, complete=False) == "unverified"
    assert state("a", complete=False) == "unverified"


# --- a degraded mount's summary -------------------------------------------------------------
def test_a_degraded_mount_counts_its_classes_as_unverified():
    """Past --inventory.max-segments a mount keeps counts and bytes by class only: they are
    summarised as unverified, next to what is listed, and the summary says it is degraded."""
    degraded = {"torch": ClassTotals(count=3, allocated_bytes=12 * MiB, apparent_bytes=12 * MiB + 7),
                "nccl": ClassTotals(count=2, allocated_bytes=4 * MiB, apparent_bytes=5 * MiB)}
    inv = MountInventory("/dev/shm", degraded=degraded, names=("torch_x",),
                         packed=(pack(CLASS_NAMES.index("torch"), 0, 9, 0, MiB // 512, MiB + 1),),
                         states=bytes([3]))  # unverified
    s = summarise(inv, 5)
    assert s.degraded is True
    assert totals(s.totals[("torch", "unverified")]) == (4, 13 * MiB, 13 * MiB + 8)
    assert totals(s.totals[("nccl", "unverified")]) == (2, 4 * MiB, 5 * MiB)
    assert s.totals.keys() == {("torch", "unverified"), ("nccl", "unverified")}
    assert s.bytes_by_class == {"torch": 13 * MiB, "nccl": 4 * MiB}
    assert [x.name for x in s.unverified] == ["torch_x"]  # no names kept for the rest
    assert summarise(MountInventory("/dev/shm"), 5).degraded is False
    assert summarise(MountInventory("/dev/shm", degraded={}), 5).degraded is True  # past the cap, all gone


def test_past_the_listed_cap_the_largest_leaks_are_named_of_each_kind():
    """Fifty (LISTED) named of the removable orphans, fifty of the others, fifty unverified:
    the largest, largest first; the oldest orphan is the oldest removable one wherever it
    comes in the listing."""
    from exporter.model.summary import LISTED
    from exporter.model.types import STATES
    listed, states, n = {}, bytearray(), LISTED + 10
    for i in range(n):  # the smallest and the oldest first
        for cls, state, prefix in (("torch", "orphan", "t"), ("other", "orphan", "o"), ("nccl", "unverified", "u")):
            listed[f"{prefix}{i:03}"] = pack(CLASS_NAMES.index(cls), 0, len(listed) + 1, 1000 + i, i + 1, 512 * (i + 1))
            states.append(STATES.index(state))
    inv = MountInventory("/dev/shm", names=tuple(listed), packed=tuple(listed.values()), states=bytes(states))
    s = summarise(inv, 3)
    removable = [f"t{i:03}" for i in range(n - 1, n - 1 - LISTED, -1)]
    others = [f"o{i:03}" for i in range(n - 1, n - 1 - LISTED, -1)]
    assert [x.name for x in s.leaked] == [name for pair in zip(others, removable) for name in pair]
    assert [x.name for x in s.unverified] == [f"u{i:03}" for i in range(n - 1, n - 1 - LISTED, -1)]
    assert s.oldest_orphan_mtime == 1000
    orphans = (n, sum(512 * (i + 1) for i in range(n)))
    assert totals(s.totals["torch", "orphan"])[:2] == totals(s.totals["other", "orphan"])[:2] == orphans


# --- the packed row ---------------------------------------------------------------------------
def test_every_field_round_trips_at_its_width():
    """Each field at its widest, the others too, then alone: none spills into another."""
    ino, mtime, blocks, size = (1 << 64) - 1, (1 << 40) - 1, (1 << 48) - 1, (1 << 70) + 3
    row = pack(31, KNOWN, ino, mtime, blocks, size)
    assert unpack(row) == (31, ino, mtime, blocks * 512, size)
    assert row & KNOWN
    assert unpack(pack(0, 0, ino, 0, 0, 0)) == (0, ino, 0, 0, 0)
    assert unpack(pack(0, 0, 0, mtime, 0, 0)) == (0, 0, mtime, 0, 0)
    assert unpack(pack(0, 0, 0, 0, blocks, 0)) == (0, 0, 0, blocks * 512, 0)
    assert unpack(pack(5, 0, 0, 0, 0, 0)) == (5, 0, 0, 0, 0)
    assert pack(5, 0, 0, 0, 0, 0) & KNOWN == 0
    # Clamped, not spilled: an mtime past 40 bits, before 1970, blocks past 48 bits.
    assert unpack(pack(1, 0, 2, 1 << 41, 2, 4)) == (1, 2, mtime, 2 * 512, 4)
    assert unpack(pack(1, 0, 2, -5.5, 3, 4)) == (1, 2, 0, 3 * 512, 4)
    assert unpack(pack(1, 0, 2, 6, 1 << 50, 4)) == (1, 2, 6, blocks * 512, 4)


@pytest.mark.parametrize("mtime_ns", [
    1_796_000_000_250_000_000,  # 2026, a quarter second past
    (1 << 33) * 10**9 + 750_000_000,  # 2242: past 32 bits, three quarters past
    -3 * 10**9 - 500_000_000,  # before 1970: clamped to 0
])
def test_a_real_files_row_keeps_its_whole_second_mtime(tmp_path, mtime_ns):
    """A file's lstat, as the walk reads it: the row holds its mtime's whole seconds (the
    orphan age's resolution), its inode, blocks and size exactly."""
    path = tmp_path / "torch_1"
    path.write_bytes(b"x" * 5000)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    st = os.lstat(path)
    assert st.st_mtime_ns == mtime_ns, "the filesystem here does not keep this mtime"
    listing, events = Listing(), Counter()
    _update(listing, _File.of("torch_1", st), events)
    cls, ino, mtime, allocated, apparent = unpack(listing.rows["torch_1"])
    assert (CLASS_NAMES[cls], ino, allocated, apparent) == ("torch", st.st_ino, st.st_blocks * 512, 5000)
    assert mtime == max(0, mtime_ns // 10**9)
    assert events == {("torch", "created"): 1}


def test_a_row_keeps_its_class_and_known_flag_while_it_is_the_same_inode(tmp_path):
    """The same inode again: its class (as first classified) and known flag kept, no event.
    Another inode under the name: classified afresh, not known, and counted deleted and
    created."""
    path = tmp_path / "nccl-shm-1"
    path.write_bytes(b"y" * 100)
    st = os.lstat(path)
    listing = Listing()
    old = pack(CLASS_NAMES.index("torch"), KNOWN, st.st_ino, 0, 0, 0)
    listing.rows["nccl-shm-1"] = old
    events = Counter()
    _update(listing, _File.of("nccl-shm-1", st), events)
    row = listing.rows["nccl-shm-1"]
    assert events == {}
    assert row & KNOWN and CLASS_NAMES[row & 31] == "torch"
    assert unpack(row)[1:] == (st.st_ino, int(st.st_mtime), st.st_blocks * 512, 100)
    listing.rows["nccl-shm-1"] = pack(CLASS_NAMES.index("ucx"), 0, st.st_ino, 12345, 77, 999)
    _update(listing, _File.of("nccl-shm-1", st), events)  # not known stays not known; fields from lstat
    assert listing.rows["nccl-shm-1"] == pack(CLASS_NAMES.index("ucx"), 0, st.st_ino, st.st_mtime, st.st_blocks, 100)
    listing.rows["nccl-shm-1"] = pack(CLASS_NAMES.index("torch"), KNOWN, st.st_ino + 1, 0, 0, 0)
    _update(listing, _File.of("nccl-shm-1", st), events)
    row = listing.rows["nccl-shm-1"]
    assert events == {("torch", "deleted"): 1, ("nccl", "created"): 1}
    assert not row & KNOWN and CLASS_NAMES[row & 31] == "nccl"
    _update(listing, _File.of("vader_segment.host.0.1", st), events)  # mpi: class 0, no stray bit
    assert listing.rows["vader_segment.host.0.1"] == pack(CLASS_NAMES.index("mpi"), 0, st.st_ino, st.st_mtime, st.st_blocks, 100)


# --- where a cgroup's limit binds -----------------------------------------------------------
UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def cgroup_tree(root, limits, version=1):
    """kubepods/burstable/pod<UID>/ctr under `root`, each level's limit file written (None:
    unlimited), with a memory.stat; -> the container's directory."""
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    unlimited = "max" if version == 2 else str(9223372036854771712)
    directory = root
    for level, limit in zip(("kubepods", "burstable", f"pod{UID}", "ctr"), limits):
        directory = os.path.join(directory, level)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, name), "w") as f:
            f.write(f"{unlimited if limit is None else limit}\n")
        with open(os.path.join(directory, "memory.stat"), "w") as f:
            f.write("cache 0\n")
    return directory


@pytest.mark.parametrize("version", [1, 2])
def test_of_equal_limits_the_outermost_binds(tmp_path, version):
    """(kubepods, burstable, pod, container) limits -> (limit, where it binds): the smallest;
    of equal ones the outermost (a container as tight as its pod is read as the pod)."""
    cases = {
        (None, None, GiB, GiB): (GiB, "pod"),
        (None, GiB, GiB, GiB): (GiB, "ancestor"),
        (None, GiB, 2 * GiB, GiB): (GiB, "ancestor"),
        (None, None, GiB, GiB - 4096): (GiB - 4096, "self"),
        (None, None, GiB, None): (GiB, "pod"),
        (GiB, None, 2 * GiB, None): (GiB, "ancestor"),
        (None, None, None, GiB): (GiB, "self"),
        (None, None, None, None): (None, "none"),
    }
    for i, (limits, (limit, where)) in enumerate(cases.items()):
        want = BindingLimit(limit_bytes=limit, limit_source=where)
        ctr = cgroup_tree(str(tmp_path / str(i)), limits, version)
        assert effective_limit(ctr, version) == want, limits
        above = {}
        assert effective_limit(ctr, version, above) == want, limits
        assert effective_limit(ctr, version, above) == want, limits  # from the memo
        # A private cgroup namespace's own cgroup: "/", read at "/sys/fs/cgroup/".
        assert effective_limit(ctr + "/", version) == want, limits


def test_limits_are_read_up_to_the_top_of_the_hierarchy_and_once_a_pass(tmp_path):
    """A limit file above a directory without one (above the hierarchy's root: the host's,
    a fixture's) is not a cgroup's. The ancestors' limits are read once per pass (node mode's
    pods share their QoS slices): a memo passed again gives what it read."""
    with open(tmp_path / "memory.limit_in_bytes", "w") as f:
        f.write("4096\n")
    os.mkdir(tmp_path / "root")  # no limit file: the top
    ctr = cgroup_tree(str(tmp_path / "root"), (None, None, GiB, 2 * GiB))
    above = {}
    assert effective_limit(ctr, 1, above) == BindingLimit(limit_bytes=GiB, limit_source="pod")
    with open(os.path.join(os.path.dirname(ctr), "memory.limit_in_bytes"), "w") as f:
        f.write(f"{GiB // 2}\n")
    assert effective_limit(ctr, 1, above) == BindingLimit(limit_bytes=GiB, limit_source="pod")  # this pass's
    assert effective_limit(ctr, 1) == BindingLimit(limit_bytes=GiB // 2, limit_source="pod")  # the next pass's


def test_a_container_as_tight_as_its_pod_is_charged_to_the_pod(tmp_path):
    """binding: the container's own cgroup only when its own limit is the tightest; else its
    pod's, when the pod's memory.stat can be read."""

    def at(path: str, version: int, directory: str) -> CgroupAt:
        return CgroupAt(path=path, version=version, directory=directory)

    def binding(path: str, version: int, directory: str) -> CgroupAt:
        return CgroupCollector.binding(at(path, version, directory))

    cgroup = f"/kubepods/burstable/pod{UID}/ctr"
    pod = f"/kubepods/burstable/pod{UID}"
    own = cgroup_tree(str(tmp_path / "own"), (None, None, 2 * GiB, GiB))
    assert binding(cgroup, 1, own) == at(cgroup, 1, own)
    own2 = cgroup_tree(str(tmp_path / "own2"), (None, None, 2 * GiB, GiB), version=2)
    assert binding(cgroup, 2, own2) == at(cgroup, 2, own2)
    assert binding(cgroup + "/", 1, own + "/") == at(cgroup + "/", 1, own + "/")
    tie = cgroup_tree(str(tmp_path / "tie"), (None, None, GiB, GiB))
    assert binding(cgroup, 1, tie + "/") == at(pod, 1, os.path.dirname(tie))
    none = cgroup_tree(str(tmp_path / "none"), (None, None, None, None))
    assert binding(cgroup, 1, none) == at(pod, 1, os.path.dirname(none))
    assert binding(cgroup + "/", 1, none) == at(pod, 1, os.path.dirname(none))
    # A cgroup namespace rooted at the QoS level: the pod is one level below its root.
    assert binding(f"/pod{UID}/ctr", 1, none) == at(f"/pod{UID}", 1, os.path.dirname(none))
    os.remove(os.path.join(os.path.dirname(tie), "memory.stat"))
    assert binding(cgroup, 1, tie) == at(cgroup, 1, tie)  # the pod's unreadable
    outside = cgroup_tree(str(tmp_path / "outside"), (None, None, None, None))
    assert binding("/system.slice/x", 1, outside) == at("/system.slice/x", 1, outside)


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


# --- mounts polled gone, or as another instance ---------------------------------------------
def test_a_mount_polled_gone_takes_no_samples_until_it_is_back():
    """Gone: its peak and high-water mark start afresh, and the watcher's samples (the disk
    beneath) are dropped until a poll finds it again; a passing error on the same instance
    or an unknown instance keeps them."""
    now = [100.0]
    store = StateStore(peak_window=60.0, clock=lambda: now[0], wall_clock=lambda: 5000.0)

    def usage(used=0, instance=None, error=None):
        return MountUsage("/m", "tmpfs", "shm", True, error=error, used_bytes=used, instance=instance)

    def snap():
        s = store.snapshot()
        high = s.max_used.get("/m")
        return s.peaks.get("/m"), high and (high.used_bytes, high.at)

    first = MountInstance(device="0:42", mount_id=7)
    store.record_polled([usage(900, first), usage(50, first)])
    assert snap() == (900, (900, 5000.0))
    store.record_polled([usage(error="Input/output error", instance=first)])
    store.record_used("/m", 300)
    assert snap() == (900, (900, 5000.0))  # the same mount, still sampled
    store.record_polled([usage(error="not a mount point")])
    assert snap() == (None, None)
    store.record_used("/m", 700)
    assert snap() == (None, None)  # the disk beneath: not sampled
    store.record_polled([usage(200, MountInstance(device="0:43", mount_id=8))])
    assert snap() == (200, (200, 5000.0))  # back, another instance
    store.record_used("/m", 250)
    assert snap() == (250, (250, 5000.0))
    store.record_polled([usage(100)])  # the table could not say: proves nothing
    assert snap() == (250, (250, 5000.0))
    store.record_polled([usage(100, MountInstance(device="0:43", mount_id=8))])
    assert snap() == (250, (250, 5000.0))
