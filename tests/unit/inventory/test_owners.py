# mypy: allow-untyped-calls
"""Who holds which segment, from one pass over a /proc tree (tests/helpers.FakeProc) joined
with real files by (device, inode): linked and hidden holders, their sizes, and whether a
segment nobody holds may be called leaked (every process that could hold it was read).
Fast, no root processes: part of the mutation-testing selection."""

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple

import pytest

from exporter.host.proctable import PF_KTHREAD, ProcessTable
from exporter.inventory.holdings import Owners, Sizes
from exporter.inventory.owners import OwnerScan
from tests.conftest import IS_ROOT, prerequisite_missing
from tests.helpers import FakeProc, devno, maps_line, mountinfo_line

# The watched mount's ID in every fixture process's mountinfo: no real mount's (the memfd
# tests list the test process's own fds).
MNT_ID = 987654


@dataclass
class World:
    shm: Path  # the watched mount: a directory of real files
    proc: FakeProc
    dev: int

    def segment(self, name: str, size: int = 8192) -> Tuple[int, int]:
        """A file on the mount, its pages allocated -> its (device, inode)."""
        path = self.shm / name
        path.write_bytes(b"x" * size)
        return self.dev, os.stat(path).st_ino

    def mountinfo(self) -> str:
        return mountinfo_line(MNT_ID, devno(self.dev), str(self.shm))

    def add(self, pid: int, comm: str = "python3", **fields: Any) -> None:
        fields.setdefault("mountinfo", self.mountinfo())
        self.proc.add(pid, comm, **fields)

    def scan(
        self, ignore: Optional[str] = None, pods: bool = False
    ) -> Tuple[OwnerScan, Owners]:
        table = ProcessTable(self.proc.paths)
        scan = OwnerScan(table, re.compile(ignore) if ignore else None)
        return scan, scan.scan({self.dev}, pods=pods)


def make_world(tmp_path: Path) -> World:
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = FakeProc(str(tmp_path / "proc"))
    proc.self_links(
        pid_ns=f"pid:[{0xEFFFFFFC}]"
    )  # the host's PID namespace: all is listed
    return World(shm, proc, os.stat(shm).st_dev)


@pytest.fixture
def world(tmp_path: Path) -> World:
    return make_world(tmp_path)


def as_uid(uid: int) -> int:
    if not IS_ROOT:
        prerequisite_missing("needs root to own a fixture /proc/<pid> as another UID")
    return uid


def sizes(owners: Owners, key: Tuple[int, int]) -> Tuple[int, int, float]:
    """(allocated, apparent, mtime) of its one holding, which has them."""
    [held] = owners.holdings[key]
    assert held.sizes is not None
    return (held.sizes.allocated_bytes, held.sizes.apparent_bytes, held.sizes.mtime)


def holders(owners: Owners, key: Tuple[int, int]) -> List[int]:
    return sorted(h.pid for h in owners.holdings.get(key, []))


def test_mapped_and_open_segments_are_held_by_their_processes(world: World) -> None:
    nccl = world.segment("nccl-a", 8192)
    torch = world.segment("torch_1", 12288)
    world.add(
        100,
        "python3",
        maps=maps_line(0x1000, 0x3000, world.dev, nccl[1], str(world.shm / "nccl-a")),
    )
    world.add(
        101,
        "vllm",
        fds={7: str(world.shm / "torch_1"), 8: "socket:[123]"},
        mnt_ids={7: MNT_ID},
    )
    world.add(102, "idle")
    _, owners = world.scan()
    assert holders(owners, nccl) == [100] and holders(owners, torch) == [101]
    assert owners.comms == {100: "python3", 101: "vllm"}
    assert sorted(owners.holders) == [100, 101] and sorted(owners.processes) == [
        100,
        101,
        102,
    ]
    assert (
        owners.scanned,
        owners.unreadable,
        owners.unverifiable,
        owners.complete,
    ) == (3, 0, 0, True)
    assert owners.unproven == []
    [mapped] = owners.holdings[nccl]
    assert (mapped.deleted, mapped.extent, mapped.sizes) == (False, 0x2000, None)
    [opened] = owners.holdings[torch]
    st = os.stat(world.shm / "torch_1")
    assert (
        opened.sizes
        == Sizes(
            allocated_bytes=st.st_blocks * 512, apparent_bytes=12288, mtime=st.st_mtime
        )
        and not opened.deleted
    )


def test_an_unlinked_segment_still_mapped_is_held_hidden_with_its_size(
    world: World,
) -> None:
    backing = world.segment(
        "backing", 16384
    )  # stands for the unlinked inode, through map_files
    maps = maps_line(
        0x10000, 0x12000, world.dev, backing[1], "/dev/shm/nccl-x (deleted)"
    )
    maps += maps_line(
        0x20000, 0x23000, world.dev, 555, "/dev/shm/psm_y (deleted)", offset=0x1000
    )
    world.add(100, "python3", maps=maps)
    world.proc.map_file(100, "10000-12000", str(world.shm / "backing"))
    _, owners = world.scan()
    [hidden] = owners.holdings[backing]
    st = os.stat(world.shm / "backing")
    assert hidden.deleted and hidden.sizes == Sizes(
        allocated_bytes=st.st_blocks * 512, apparent_bytes=16384, mtime=st.st_mtime
    )
    [no_stat] = owners.holdings[
        (world.dev, 555)
    ]  # no map_files to stat: its extent stands in
    assert no_stat.deleted and no_stat.sizes is None and no_stat.extent == 0x4000


def test_a_stat_through_map_files_of_another_inode_is_not_taken(world: World) -> None:
    other = world.segment("other", 4096)
    world.add(
        100, maps=maps_line(0x1000, 0x2000, world.dev, 777, "/dev/shm/psm_z (deleted)")
    )
    world.proc.map_file(100, "1000-2000", str(world.shm / "other"))
    _, owners = world.scan()
    assert owners.holdings[(world.dev, 777)][0].sizes is None
    assert other not in owners.holdings


def test_a_file_on_another_device_or_mount_is_not_a_segment(
    world: World, tmp_path: Path
) -> None:
    elsewhere = world.segment("nccl-b")
    world.add(
        100,
        maps=maps_line(0x1000, 0x2000, world.dev + 1, elsewhere[1], "/dev/shm/nccl-b"),
    )
    # An fd on a mount that is not the watched one (mnt_id 99): never stat'ed, not held.
    world.add(101, fds={3: str(world.shm / "nccl-b")}, mnt_ids={3: 99})
    _, owners = world.scan()
    assert owners.holdings == {} and owners.holders == {}


def test_an_fd_whose_fdinfo_has_no_mount_id_is_stated_to_tell(world: World) -> None:
    key = world.segment("psm_old")
    world.add(100, fds={3: str(world.shm / "psm_old")}, mnt_ids={})  # before Linux 3.15
    _, owners = world.scan()
    assert holders(owners, key) == [100]


def test_a_holder_is_named_by_its_comm_now(world: World) -> None:
    key = world.segment("nccl-c")
    world.add(
        100,
        "python3",
        maps=maps_line(0x1000, 0x2000, world.dev, key[1], "/dev/shm/nccl-c"),
    )
    world.proc.write("100/comm", "vllm-engine\n")  # exec'ed since its stat was read
    world.add(101, "ray", fds={3: str(world.shm / "nccl-c")}, mnt_ids={3: MNT_ID})
    os.unlink(world.proc.path(101, "comm"))
    _, owners = world.scan()
    assert owners.comms == {100: "vllm-engine", 101: "ray"}


def test_a_process_whose_stat_cannot_be_read_could_hold_anything(world: World) -> None:
    world.add(100)
    world.add(200)
    os.unlink(world.proc.path(200, "stat"))
    os.mkdir(world.proc.path(200, "stat"))  # read fails (not "gone")
    world.add(300)
    os.unlink(world.proc.path(300, "stat"))  # gone since listed: not counted
    _, owners = world.scan()
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (1, 1, False)
    assert owners.unproven == ["1 process(es) whose stat could not be read"]
    assert sorted(owners.processes) == [100]


def test_kernel_threads_are_not_processes_that_hold_segments(world: World) -> None:
    world.add(2, "kthreadd", flags=PF_KTHREAD)
    world.add(100)
    _, owners = world.scan()
    assert sorted(owners.processes) == [100] and owners.scanned == 1


def test_a_process_whose_maps_are_denied_makes_unheld_segments_unverified(
    world: World,
) -> None:
    world.add(100, uid=as_uid(1000))
    world.proc.deny(100, "maps")
    world.add(101)
    _, owners = world.scan()
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (1, 1, False)
    assert owners.unproven == ["python3 (pid 100, uid 1000)"]


def test_a_process_whose_mountinfo_is_denied_is_unread_too(world: World) -> None:
    key = world.segment("torch_9")
    world.add(100, fds={3: str(world.shm / "torch_9")}, mnt_ids={3: MNT_ID})
    world.proc.deny(100, "mountinfo")  # no telling which fds are safe to stat
    _, owners = world.scan()
    assert key not in owners.holdings
    assert (owners.unreadable, owners.unverifiable) == (1, 1)


def test_ignore_unreadable_excuses_roots_processes_by_name_only(world: World) -> None:
    """A VM agent as root that even root cannot read is excused; any process can name itself
    that (PR_SET_NAME): another UID's is never excused, nor a root one by another name."""
    world.add(100, "process_api", uid=as_uid(0))
    world.add(101, "process_api", uid=as_uid(1000))
    world.add(102, "sshd", uid=as_uid(0))
    for pid in (100, 101, 102):
        world.proc.deny(pid, "maps")
    _, owners = world.scan(ignore="process_api")
    assert (owners.unreadable, owners.unverifiable) == (3, 2)
    assert owners.unproven == [
        "process_api (pid 101, uid 1000)",
        "sshd (pid 102, uid 0)",
    ]
    _, strict = world.scan()
    assert (strict.unreadable, strict.unverifiable) == (3, 3)


def test_ignore_unreadable_matches_a_whole_name_not_a_part(world: World) -> None:
    """Anchored as --metric-allowlist is: searched, `process_api` excused any root process
    whose name merely contained it, and its live segments could be called orphan."""
    world.add(100, "xprocess_apix", uid=as_uid(0))
    world.add(101, "process_api", uid=as_uid(0))
    for pid in (100, 101):
        world.proc.deny(pid, "maps")
    _, owners = world.scan(ignore="process_api")
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (2, 1, False)
    assert owners.unproven == ["xprocess_apix (pid 100, uid 0)"]
    _, prefixed = world.scan(ignore="process_.*")
    assert (prefixed.unverifiable, prefixed.unproven) == (1, ["xprocess_apix (pid 100, uid 0)"])


def test_only_the_excused_unreadable_leaves_orphans_provable(world: World) -> None:
    world.add(100, "process_api", uid=as_uid(0))
    world.proc.deny(100, "maps")
    _, owners = world.scan(ignore="^process_api$")
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (1, 0, True)
    assert owners.unproven == []


@pytest.mark.parametrize("hidepid", ["2", "invisible", "4", "ptraceable"])
def test_processes_hidden_by_hidepid_are_counted_and_could_hold_anything(
    world: World, hidepid: str
) -> None:
    # pid_max 1: pid 1 is the one pid there can be, and it exists but is not listed.
    world.proc.counters(last_pid=1, pid_max=1, forks=10)
    world.proc.self_mountinfo(hidepid=hidepid)
    world.add(100)
    _, owners = world.scan()
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (1, 1, False)
    assert owners.unproven == ["1 process(es) hidden by hidepid"]


@pytest.mark.parametrize("hidepid", ["0", "1", "noaccess"])
def test_hidepid_that_lists_every_process_hides_none(
    world: World, hidepid: str
) -> None:
    world.proc.counters(last_pid=1, pid_max=1, forks=10)
    world.proc.self_mountinfo(hidepid=hidepid)
    world.add(100)
    _, owners = world.scan()
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (0, 0, True)


def test_hidden_processes_that_cannot_be_counted_are_not_taken_as_none(
    world: World,
) -> None:
    world.proc.counters(
        last_pid=100000, pid_max=4194304, forks=10
    )  # too many pids to probe
    world.proc.self_mountinfo(hidepid="2")
    world.add(100)
    _, owners = world.scan()
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (
        None,
        None,
        False,
    )
    assert owners.unproven == ["hidden processes (hidepid), uncounted"]


def test_alone_in_a_pid_namespace_nothing_unheld_is_proven(tmp_path: Path) -> None:
    """A sidecar without shareProcessNamespace sees only its own container's processes (its
    mount namespace): a segment nobody is seen holding is the server's, perhaps."""
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = FakeProc(str(tmp_path / "proc"))
    proc.add(1, "sh", ppid=0, mnt_ns="mnt:[1]")
    proc.add(7, "shmwatch", ppid=1, mnt_ns="mnt:[1]")
    proc.add(
        9, "shmwatch", ppid=7, mnt_ns="mnt:[1]"
    )  # its own child (a collector's helper)
    proc.self_links(pid=7)
    world = World(shm, proc, os.stat(shm).st_dev)
    _, owners = world.scan()
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (
        None,
        None,
        False,
    )
    assert owners.unproven == [
        "the workload's processes: none visible (a PID namespace of its own)"
    ]
    proc.add(
        12, "vllm", ppid=1, mnt_ns="mnt:[2]"
    )  # the server shares it, from its container
    _, owners = world.scan()
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (0, 0, True)


def test_an_open_file_unlinked_since_is_held_hidden(world: World) -> None:
    key = world.segment("torch_2 (deleted)")  # what readlink shows of an unlinked file
    world.add(100, fds={3: str(world.shm / "torch_2 (deleted)")}, mnt_ids={3: MNT_ID})
    _, owners = world.scan()
    [held] = owners.holdings[key]
    assert held.deleted is True and held.sizes is not None


def test_one_process_mapping_and_holding_open_one_segment_holds_it_once(
    world: World,
) -> None:
    key = world.segment("psm_both", 8192)
    path = str(world.shm / "psm_both")
    world.add(
        100,
        maps=maps_line(0x1000, 0x3000, world.dev, key[1], path),
        fds={3: path},
        mnt_ids={3: MNT_ID},
    )
    _, owners = world.scan()
    [held] = owners.holdings[key]
    assert (held.pid, held.extent, held.map_range) == (
        100,
        0x2000,
        "1000-3000",
    ) and held.sizes is not None


def test_every_fd_is_looked_at_whatever_comes_before_it(world: World) -> None:
    """Sockets, pipes and fds closed meanwhile (a dangling link) among the segments."""
    fds, keys = {}, []
    for i in range(6):
        keys.append(world.segment(f"psm_{i}"))
        fds[10 + 3 * i] = str(world.shm / f"psm_{i}")
        fds[11 + 3 * i] = f"pipe:[{i}]"
        fds[12 + 3 * i] = str(world.shm / f"closed_{i}")  # no such file: its stat fails
    (world.shm / "subdir").mkdir()
    os.mkfifo(world.shm / "fifo")
    fds[30], fds[31] = (
        str(world.shm / "subdir"),
        str(world.shm / "fifo"),
    )  # not files: not segments
    world.add(100, fds=fds, mnt_ids={fd: MNT_ID for fd in fds})
    _, owners = world.scan()
    assert sorted(owners.holdings) == sorted(keys)


def test_an_fd_passed_from_another_mount_namespace_is_held(world: World) -> None:
    """Its holder's namespace does not mount the watched tmpfs; the sender's does: mount IDs
    are unique across namespaces, so the union of the watched ones tells."""
    key = world.segment("nccl-passed")
    world.add(100)  # mounts it
    world.add(
        101, mountinfo="", fds={3: str(world.shm / "nccl-passed")}, mnt_ids={3: MNT_ID}
    )
    _, owners = world.scan()
    assert holders(owners, key) == [101]


def test_fds_are_not_stated_where_the_mountinfo_is_unread(world: World) -> None:
    key = world.segment("torch_8")
    world.add(99)  # another process mounts it: the watched mount ID is known
    world.add(100, fds={3: str(world.shm / "torch_8")}, mnt_ids={3: MNT_ID})
    world.proc.deny(100, "mountinfo")
    _, owners = world.scan()
    assert key not in owners.holdings and (owners.unreadable, owners.unverifiable) == (
        1,
        1,
    )


def test_a_process_that_exits_while_read_is_not_unreadable(world: World) -> None:
    world.add(100)
    shutil.rmtree(world.proc.path(100, "fd"))  # gone between its maps and its fds
    os.unlink(world.proc.path(100, "maps"))
    _, owners = world.scan()
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (0, 0, True)


def test_a_denied_process_stays_unreadable_whatever_follows(world: World) -> None:
    world.add(100, uid=as_uid(1000))
    world.proc.deny(100, "maps")
    shutil.rmtree(world.proc.path(100, "fd"))  # and its fds gone since
    world.add(101, uid=as_uid(1000))
    world.proc.deny(101, "mountinfo")
    os.unlink(world.proc.path(101, "maps"))  # and its maps gone since
    _, owners = world.scan()
    assert (owners.unreadable, owners.unverifiable) == (2, 2)


def test_stat_through_map_files_for_each_unlinked_mapping(world: World) -> None:
    linked = world.segment("nccl-linked")
    first, second = world.segment("backing-1", 4096), world.segment("backing-2", 12288)
    maps = maps_line(
        0x1000, 0x2000, world.dev, linked[1], str(world.shm / "nccl-linked")
    )
    maps += maps_line(0x3000, 0x4000, world.dev, first[1], "/dev/shm/psm_1 (deleted)")
    maps += maps_line(0x5000, 0x6000, world.dev, second[1], "/dev/shm/psm_2 (deleted)")
    world.add(100, maps=maps)
    world.proc.map_file(100, "3000-4000", str(world.shm / "backing-1"))
    world.proc.map_file(100, "5000-6000", str(world.shm / "backing-2"))
    world.proc.map_file(100, "1000-2000", str(world.shm / "nccl-linked"))
    _, owners = world.scan()
    # linked: the listing has its sizes, no stat through map_files (thousands a scan)
    assert owners.holdings[linked][0].sizes is None
    assert sizes(owners, first)[:2] == (4096, 4096)
    assert sizes(owners, second)[:2] == (12288, 12288)


class Unlistable(ProcessTable):
    """/proc that cannot be listed again once walked (its mount gone, EMFILE)."""

    listed = 0

    def pids(self) -> List[int]:
        self.listed += 1
        if self.listed > 1:
            raise OSError(24, "Too many open files")
        return super().pids()


def test_a_proc_that_cannot_be_listed_again_ends_the_scan_with_what_was_read(
    world: World,
) -> None:
    key = world.segment("nccl-z")
    world.add(100, maps=maps_line(0x1000, 0x2000, world.dev, key[1], "/dev/shm/nccl-z"))
    owners = OwnerScan(Unlistable(world.proc.paths)).scan({world.dev})
    assert holders(owners, key) == [100] and owners.complete


def test_a_process_holding_many_files_open_holds_each(world: World) -> None:
    """Files are not memfds: however many, each is held one by one, none counted by class."""
    keys = [world.segment(f"psm_{i}") for i in range(70)]
    world.add(
        100,
        fds={10 + i: str(world.shm / f"psm_{i}") for i in range(70)},
        mnt_ids={10 + i: MNT_ID for i in range(70)},
    )
    _, owners = world.scan()
    assert sorted(owners.holdings) == sorted(keys) and owners.memfd_rest == {}
