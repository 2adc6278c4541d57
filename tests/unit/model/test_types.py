"""model/types.py: the records the sources return, and the packed inventory row behind `Row`:
every field comes back as packed, at its widths' edges, and an inventory's rows join the
listing's names, rows, states and holders by position and inode."""

import os
from collections import Counter
from typing import List

import pytest

from exporter.inventory.walk import Listing, _update
from exporter.model.classes import CLASS_NAMES
from exporter.model.types import (
    STATES,
    CgroupMemory,
    ClassTally,
    ClassTotals,
    Inventory,
    MountInventory,
    MountSet,
    MountUsage,
    Observation,
    OomKill,
    PackedRow,
    Row,
    Segment,
    SysvSegment,
    SysvShm,
    Target,
)
from tests.helpers import KNOWN, pack, unpack

POD = "0a1b2c3d-1111-2222-3333-444455556666"


def test_a_packed_row_gives_back_every_field() -> None:
    row = Row.pack(CLASS_NAMES.index("nccl"), inode=123456789, mtime=1_700_000_000.9,
                   blocks=8, apparent_bytes=4096)
    assert Row.class_index(row) == CLASS_NAMES.index("nccl")
    assert Row.class_name(row) == "nccl"
    assert Row.inode(row) == 123456789
    assert Row.mtime(row) == 1_700_000_000  # whole seconds
    assert Row.allocated_bytes(row) == 8 * 512
    assert Row.apparent_bytes(row) == 4096
    assert not Row.known(row)


def test_fields_at_their_widths_edges_do_not_spill_into_their_neighbours() -> None:
    """The widest inode (64 bits), the last class, a sparse file larger than 2**64 bytes:
    each field reads back whole and the others stay as they were."""
    last_class = len(CLASS_NAMES) - 1
    row = Row.pack(last_class, inode=(1 << 64) - 1, mtime=0, blocks=0, apparent_bytes=1 << 70)
    assert Row.class_name(row) == CLASS_NAMES[-1]
    assert Row.inode(row) == (1 << 64) - 1
    assert Row.mtime(row) == 0 and Row.allocated_bytes(row) == 0
    assert Row.apparent_bytes(row) == 1 << 70
    assert not Row.known(row)


def test_mtime_and_blocks_are_clamped_to_their_bits() -> None:
    before_1970 = Row.pack(0, inode=1, mtime=-5.0, blocks=1, apparent_bytes=1)
    assert Row.mtime(before_1970) == 0
    far = Row.pack(0, inode=1, mtime=float(1 << 45), blocks=1 << 50, apparent_bytes=1)
    assert Row.mtime(far) == (1 << 40) - 1
    assert Row.allocated_bytes(far) == ((1 << 48) - 1) * 512
    assert Row.inode(far) == 1 and Row.apparent_bytes(far) == 1


def test_known_is_a_flag_marking_keeps_the_rest() -> None:
    row = Row.pack(3, inode=77, mtime=1000, blocks=2, apparent_bytes=100)
    marked = Row.marked_known(row)
    assert Row.known(marked) and Row.marked_known(marked) == marked
    assert Row.known(Row.pack(3, inode=77, mtime=1000, blocks=2, apparent_bytes=100, known=True))
    for field in (Row.class_index, Row.inode, Row.mtime, Row.allocated_bytes, Row.apparent_bytes):
        assert field(marked) == field(row)


def test_an_empty_files_row_is_a_short_int() -> None:
    """The sizes lie highest: a row of an empty file stays under the size bits."""
    assert Row.pack(1, inode=5, mtime=1, blocks=0, apparent_bytes=0).bit_length() <= 158


def inventory(**fields: object) -> MountInventory:
    packed = (
        Row.pack(CLASS_NAMES.index("nccl"), inode=11, mtime=100, blocks=8, apparent_bytes=4000),
        Row.pack(CLASS_NAMES.index("mpi"), inode=12, mtime=200, blocks=0, apparent_bytes=0),
    )
    hidden = Segment(name="gone", cls="torch", state="hidden", allocated_bytes=512, apparent_bytes=512,
                     holders=(9,), key=(42, 99))
    base = dict(mount="/dev/shm", dev=42, names=("nccl-a", "mpi-b"), packed=packed,
                states=bytes([STATES.index("linked"), STATES.index("orphan")]),
                held={11: (7, 8)}, hidden=(hidden,))
    base.update(fields)
    return MountInventory(**base)  # type: ignore[arg-type]


def test_rows_are_the_hidden_then_each_listed_file_joined_by_position_and_inode() -> None:
    rows: List[Segment] = list(inventory().rows())
    assert [r.name for r in rows] == ["gone", "nccl-a", "mpi-b"]
    nccl, second = rows[1], rows[2]
    assert (nccl.cls, nccl.state, nccl.allocated_bytes, nccl.apparent_bytes, nccl.mtime) == (
        "nccl", "linked", 4096, 4000, 100)
    assert nccl.holders == (7, 8) and nccl.key == (42, 11)
    assert (second.cls, second.state, second.holders, second.key) == ("mpi", "orphan", (), (42, 12))


def test_files_counts_the_rows_and_the_files_counted_by_class_past_the_cap() -> None:
    assert inventory().files == 2  # the hidden one is no listed file
    degraded = {"nccl": ClassTotals(count=3, allocated_bytes=3 * 4096, apparent_bytes=3 * 4000),
                "other": ClassTotals(count=2)}
    assert inventory(names=(), packed=(), states=b"", degraded=degraded).files == 5


def test_class_totals_add_up() -> None:
    tally = ClassTally.of(ClassTotals(count=1, allocated_bytes=4096, apparent_bytes=10))
    tally.add(4096, 10)
    tally.add(4096, 10)
    assert tally.totals() == ClassTotals(count=3, allocated_bytes=12288, apparent_bytes=30)


def test_ratios_without_a_size_or_a_limit() -> None:
    usage = MountUsage(mount="/m", fstype="tmpfs", source="shm", is_mount_point=True,
                       size_bytes=1000, used_bytes=250)
    assert usage.usage_ratio == 0.25
    empty = MountUsage(mount="/m", fstype="tmpfs", source="shm", is_mount_point=True)
    assert empty.usage_ratio == 0.0
    cgroup = CgroupMemory(cgroup="/a", version=2, usage_bytes=10, limit_bytes=None, working_set_bytes=5,
                          shmem_bytes=None, oom_kills=None, limit_source="none")
    assert cgroup.oom_risk_ratio is None  # unlimited: no ratio, not 0
    limited = CgroupMemory(cgroup="/a", version=2, usage_bytes=10, limit_bytes=20, working_set_bytes=5,
                           shmem_bytes=None, oom_kills=None, limit_source="self")
    assert limited.oom_risk_ratio == 0.25


def kill(task_memcg: str) -> OomKill:
    return OomKill(seq=1, boot_usec=2, pid=3, comm="python", task_memcg=task_memcg, oom_memcg="",
                   constraint="CONSTRAINT_MEMCG", anon_rss_bytes=None, file_rss_bytes=None,
                   shmem_rss_bytes=None)


def test_an_oom_kills_pod_is_read_off_the_victims_cgroup() -> None:
    systemd = kill(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}"
                   ".slice/cri-containerd-abc.scope")
    assert systemd.pod_uid == POD
    assert systemd.pod_cgroup.endswith(f"pod{POD.replace('-', '_')}.slice")
    cgroupfs = kill(f"/kubepods/burstable/pod{POD}/abc")
    assert (cgroupfs.pod_uid, cgroupfs.pod_cgroup) == (POD, f"/kubepods/burstable/pod{POD}")
    outside = kill("/system.slice/ssh.service")
    assert (outside.pod_uid, outside.pod_cgroup) == ("", "")


def test_sysv_totals_and_orphans() -> None:
    segments = [SysvSegment(key=1, shmid=1, size_bytes=100, nattch=0, cpid=5, rss_bytes=40, orphan=True),
                SysvSegment(key=2, shmid=2, size_bytes=300, nattch=1, cpid=6, rss_bytes=0)]
    shm = SysvShm(segments=segments, shmmax_bytes=None, shmall_bytes=None, shmmni=None)
    assert (shm.total_bytes, shm.resident_bytes, shm.orphans) == (400, 40, 1)


def test_an_inventorys_time_is_not_compared() -> None:
    made = dict(mounts=[], comms={}, proc_unreadable=0, processes_scanned=1)
    assert Inventory(wall_time=1.0, **made) == Inventory(wall_time=2.0, **made)  # type: ignore[arg-type]


def test_a_mount_set_lists_its_targets_mounts_in_order_and_an_observation_its_success() -> None:
    assert MountSet([Target("/b"), Target("/a", {"pod_uid": POD})]).mounts() == ["/b", "/a"]
    assert Observation("shm_mount", [], None, 0.1).success
    assert not Observation("shm_mount", None, "OSError", 0.1).success


def test_packed_row_is_an_int() -> None:
    assert isinstance(Row.pack(0, 1, 1, 1, 1), int) and PackedRow(5) == 5


def test_usage_ratio():
    assert MountUsage("/m", "tmpfs", "s", True, size_bytes=200, used_bytes=50).usage_ratio == 0.25
    assert MountUsage("/m", "tmpfs", "s", True, size_bytes=0, used_bytes=50).usage_ratio == 0.0


def test_sysv_totals():
    shm = SysvShm([SysvSegment(1, 1, 100, 0, 9, 40, orphan=True), SysvSegment(2, 2, 300, 2, 9, 300),
                   SysvSegment(3, 3, 5, 0, 9, 0)], None, None, None)
    # Only what the collector found unattached with its creator and last user gone counts.
    assert (shm.total_bytes, shm.resident_bytes, shm.orphans) == (405, 340, 1)


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
    _update(listing, "torch_1", st, events)
    cls, ino, mtime, allocated, apparent = unpack(listing.rows["torch_1"])
    assert (CLASS_NAMES[cls], ino, allocated, apparent) == ("torch", st.st_ino, st.st_blocks * 512, 5000)
    assert mtime == max(0, mtime_ns // 10**9)
    assert events == {("torch", "created"): 1}


def test_peaks_are_reset_only_for_a_proven_new_mount():
    """A passing statvfs error (the same mount), or a mount table that could not be read,
    keeps the peak and high-water mark; a mount gone, or another instance, starts them afresh."""
    from exporter.model.state import StateStore
    from exporter.model.types import MountInstance, MountUsage

    store = StateStore()

    def poll(used=0, instance=None, error=None):
        store.record_polled([MountUsage("/m", "tmpfs", "shm", True, error=error, used_bytes=used,
                                        instance=instance)])
        high = store.snapshot().max_used.get("/m")
        return high and high.used_bytes

    first = MountInstance(device="0:42", mount_id=7, unique_id=1)
    assert poll(900, first) == 900
    assert poll(error="Input/output error", instance=first) == 900  # still this mount
    assert poll(100) == 900  # which instance unknown: proves nothing
    assert poll(100, first) == 900
    assert poll(100, MountInstance(device="0:42", mount_id=7, unique_id=2)) == 100  # another instance at the path
    assert poll(error="not a mount point") is None  # gone
