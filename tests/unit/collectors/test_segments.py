# mypy: allow-untyped-calls, disable-error-code="abstract"
# (the modules are untyped; mypy reads Source.close()'s empty body as abstract)
"""The segment inventory: each mount's listing (a real directory, lstat only) joined with a
/proc tree (tests/helpers.FakeProc) by (device, inode) into the states users act on:
linked, hidden, orphan (leaked: `rm` advice) only when every process was read, unverified
otherwise; quick runs between full ones; sizes, events and what no segment accounts for.
Node mode's decisions (refresh vs full scan) are in test_segments_node. Part of the
mutation selection."""

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

from exporter.collectors.segments import SegmentsCollector
from exporter.collectors.source import RunInput
from exporter.inventory.changes import ChangeLog
from exporter.host.proctable import ProcessTable, ProcessWalk
from exporter.model.types import ClassTotals, Inventory, MountInventory
from tests.helpers import (
    INITIAL_PID_NS,
    FakeProc,
    SegmentRuns,
    devno,
    maps_line,
    mountinfo_line,
)

MNT_ID = 987654


class Host:
    """Mounts (real directories) and a /proc tree whose processes map or hold their files."""

    def __init__(self, tmp_path: Path, mounts: List[str]) -> None:
        self.proc = FakeProc(str(tmp_path / "proc"))
        self.proc.self_links(pid_ns=INITIAL_PID_NS)
        self.mounts = []
        for relative in mounts:
            path = tmp_path / relative
            path.mkdir(parents=True)
            self.mounts.append(str(path))
        self.dev = os.stat(self.mounts[0]).st_dev
        self.proc.self_mountinfo(
            [
                mountinfo_line(30 + i, devno(self.dev), m)
                for i, m in enumerate(self.mounts)
            ]
        )
        self.changes = ChangeLog()

    def file(self, mount: int, name: str, size: int = 8192) -> int:
        path = Path(self.mounts[mount]) / name
        path.write_bytes(b"x" * size)
        return os.stat(path).st_ino

    def holder(
        self, pid: int, maps: str = "", comm: str = "python3", **fields: Any
    ) -> None:
        lines = "".join(
            mountinfo_line(MNT_ID + i, devno(self.dev), m)
            for i, m in enumerate(self.mounts)
        )
        self.proc.add(pid, comm, maps=maps, mountinfo=lines, **fields)

    def maps(
        self, mount: int, name: str, inode: Optional[int] = None, size: int = 0x2000
    ) -> str:
        inode = (
            inode
            if inode is not None
            else os.stat(Path(self.mounts[mount]) / name).st_ino
        )
        return maps_line(
            0x10000,
            0x10000 + size,
            self.dev,
            inode,
            os.path.join(self.mounts[mount], name),
        )

    def collector(
        self,
        table: Optional[ProcessTable] = None,
        all_watched: Callable[[], bool] = lambda: False,
        mounts: Optional[List[str]] = None,
        **options: Any,
    ) -> SegmentRuns:
        """`mounts`: handed to each run; the host's by default."""
        source = SegmentsCollector(self.proc.paths, table, **options)
        handed = (lambda: self.mounts) if mounts is None else (lambda: mounts)
        return SegmentRuns(source, handed, self.changes, all_watched)


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path, ["shm"])


def mount_of(inv: Inventory, mount: str) -> MountInventory:
    [m] = [m for m in inv.mounts if m.mount == mount]
    return m


def states(inv: Inventory, mount: str) -> Dict[str, Tuple[str, str, Tuple[int, ...]]]:
    """name -> (class, state, holders) of every segment, hidden ones too."""
    return {s.name: (s.cls, s.state, s.holders) for s in mount_of(inv, mount).rows()}


def test_a_full_run_calls_unheld_files_orphans_when_every_process_was_read(
    host: Host,
) -> None:
    host.file(0, "nccl-a", 16384)
    for name in ("psm_b", "lock", "sem.x"):
        host.file(0, name, 4096)
    maps = host.maps(0, "nccl-a") + host.maps(
        0, "torch_1 (deleted)", inode=999999, size=0x3000
    )
    host.holder(100, maps)
    host.holder(101, comm="bash")
    inv = host.collector().collect()
    [shm] = host.mounts
    assert states(inv, shm) == {
        "torch_1": ("torch", "hidden", (100,)),
        "nccl-a": ("nccl", "linked", (100,)),
        "psm_b": ("python_shm", "orphan", ()),
        "lock": ("other", "orphan", ()),
        "sem.x": ("semaphore", "orphan", ()),
    }
    m = mount_of(inv, shm)
    assert m.process_bytes == {
        100: 16384 + 0x3000
    }  # what it holds, the hidden one by its extent
    [hidden] = m.hidden
    assert (hidden.allocated_bytes, hidden.key) == (0x3000, (host.dev, 999999))
    assert (
        m.events == {} and m.error is None and m.dev == host.dev
    )  # a first listing says no events
    assert m.used_bytes > 0 and m.unattributed_bytes == max(
        0, m.used_bytes - (16384 + 3 * 4096 + 0x3000)
    )
    assert (inv.comms, inv.proc_unreadable, inv.processes_scanned) == (
        {100: "python3"},
        0,
        2,
    )
    assert (inv.owners_complete, inv.unproven, inv.pods) == (True, [], {})


def test_with_a_process_unread_unheld_files_are_unverified_and_why_is_said(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.collectors.segments")
    host.file(0, "psm_b")
    host.holder(100)
    host.proc.deny(100, "maps")
    inv = host.collector().collect()
    assert states(inv, host.mounts[0]) == {"psm_b": ("python_shm", "unverified", ())}
    assert (inv.owners_complete, inv.proc_unreadable, inv.unproven) == (
        False,
        1,
        [f"python3 (pid 100, uid {os.geteuid()})"],
    )
    assert (
        "segments held by no readable process are 'unverified', not 'orphan': could not read python3"
        in caplog.text
    )


def test_files_created_and_deleted_between_runs_are_events(host: Host) -> None:
    host.file(0, "psm_a")
    host.file(0, "nccl-b")
    collector = host.collector()
    collector.collect()
    os.unlink(Path(host.mounts[0]) / "psm_a")
    host.file(0, "torch_c")
    host.file(0, "torch_d")
    inv = collector.collect()
    assert mount_of(inv, host.mounts[0]).events == {
        ("python_shm", "deleted"): 1,
        ("torch", "created"): 2,
    }
    assert sorted(states(inv, host.mounts[0])) == ["nccl-b", "torch_c", "torch_d"]


def test_a_quick_run_lists_what_inotify_named_as_its_creators(host: Host) -> None:
    """No process is read for a quick run: a new file is taken as held by whoever made it
    (never called leaked before a full run reads /proc); the last owners stand for the rest."""
    host.file(0, "psm_old")
    host.file(0, "nccl-held")
    host.holder(100, host.maps(0, "nccl-held"))
    collector = host.collector()
    collector.collect()
    host.file(0, "psm_new")
    os.unlink(Path(host.mounts[0]) / "psm_old")
    host.changes.add(host.mounts[0], "psm_new")
    host.changes.add(host.mounts[0], "psm_old")
    quick = collector.collect_quick()
    assert states(quick, host.mounts[0]) == {
        "nccl-held": ("nccl", "linked", (100,)),
        "psm_new": ("python_shm", "linked", ()),
    }
    assert mount_of(quick, host.mounts[0]).events == {
        ("python_shm", "created"): 1,
        ("python_shm", "deleted"): 1,
    }
    full = collector.collect()
    assert states(full, host.mounts[0])["psm_new"] == ("python_shm", "orphan", ())


def test_a_quick_run_hands_back_an_unchanged_mount_as_it_was(tmp_path: Path) -> None:
    host = Host(tmp_path, ["a", "b"])
    host.file(0, "psm_a")
    host.file(1, "psm_b")
    collector = host.collector()
    first = collector.collect()
    host.file(1, "psm_c")
    host.changes.add(host.mounts[1], "psm_c")
    quick = collector.collect_quick()
    assert mount_of(quick, host.mounts[0]) is mount_of(first, host.mounts[0])
    assert sorted(states(quick, host.mounts[1])) == ["psm_b", "psm_c"]
    host.file(0, "psm_unnamed")  # inotify said nothing: a quick run does not list it
    assert "psm_unnamed" not in states(collector.collect_quick(), host.mounts[0])
    assert "psm_unnamed" in states(collector.collect(), host.mounts[0])


def test_a_name_below_a_directory_relists_the_mount(host: Host) -> None:
    collector = host.collector()
    collector.collect()
    (Path(host.mounts[0]) / "sub").mkdir()
    host.file(0, "sub/psm_deep")
    host.changes.unknown(host.mounts[0])
    assert states(collector.collect_quick(), host.mounts[0]) == {
        "sub/psm_deep": ("python_shm", "linked", ())
    }


def test_a_mount_that_is_gone_or_no_mount_is_an_error_not_an_empty_listing(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path, ["shm", "notmounted"])
    host.proc.self_mountinfo([mountinfo_line(30, devno(host.dev), host.mounts[0])])
    (tmp_path / "file").write_text("x")
    collector = host.collector(
        mounts=[*host.mounts, str(tmp_path / "gone"), str(tmp_path / "file")]
    )
    host.proc.self_mountinfo(
        [
            mountinfo_line(30 + i, devno(host.dev), m)
            for i, m in enumerate(
                [host.mounts[0], str(tmp_path / "gone"), str(tmp_path / "file")]
            )
        ]
    )
    inv = collector.collect()
    errors = {m.mount: m.error for m in inv.mounts}
    assert errors == {
        host.mounts[0]: None,
        host.mounts[1]: "not a mount point",
        str(tmp_path / "gone"): "No such file or directory",
        str(tmp_path / "file"): "not a directory",
    }


def test_past_the_segment_cap_only_counts_by_class_are_kept(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.collectors.segments")
    for i in range(5):
        host.file(0, f"psm_{i}", 4096 * (i + 1))
    collector = host.collector(max_segments=3)
    inv = collector.collect()
    m = mount_of(inv, host.mounts[0])
    assert (
        m.degraded
        == {
            "python_shm": ClassTotals(
                count=5, allocated_bytes=4096 * 15, apparent_bytes=4096 * 15
            )
        }
        and m.names == ()
    )
    assert m.unattributed_bytes == max(0, m.used_bytes - 4096 * 15)
    assert "more than 3 files (--inventory.max-segments)" in caplog.text
    for i in range(3):
        os.unlink(Path(host.mounts[0]) / f"psm_{i}")
    inv = collector.collect()
    m = mount_of(inv, host.mounts[0])
    assert m.degraded is None and sorted(states(inv, host.mounts[0])) == [
        "psm_3",
        "psm_4",
    ]
    assert m.events == {}  # across the cap: nothing to compare with
    assert "back under --inventory.max-segments" in caplog.text


def test_a_holder_of_a_memfd_is_named_with_its_cgroup(host: Host) -> None:
    memfd = maps_line(
        0x1000, 0x5000, os.makedev(0, 1), 77, "/memfd:cuda.shm.0 (deleted)"
    )
    host.holder(100, memfd, cgroup="0::/kubepods/pod-x/c\n")
    inv = host.collector().collect()
    assert [(s.name, s.cls, s.allocated_bytes, s.holders) for s in inv.memfd] == [
        ("cuda.shm.0", "cuda", 0x4000, (100,))
    ]
    assert inv.cgroup_of == {100: "/kubepods/pod-x/c"} and inv.comms == {100: "python3"}


def test_a_sidecar_has_no_staged_full_run_and_never_stretches(host: Host) -> None:
    collector = host.collector(all_watched=lambda: True)
    assert (
        collector.scans_beside_quick_runs
        is False  # its scan runs on the source's thread
        and collector.stretches is False
        and collector.follows_up
    )


def test_an_unlinked_file_held_open_is_hidden_under_its_own_name(
    host: Host, tmp_path: Path
) -> None:
    """readlink names it '<path> (deleted)': not listed, its fd's stat gives its size."""
    elsewhere = tmp_path / "unlinked"
    elsewhere.mkdir()
    (elsewhere / "torch_9 (deleted)").write_bytes(
        b"x" * 12288
    )  # on the watched device, unlisted
    host.holder(100, fds={3: str(elsewhere / "torch_9 (deleted)")}, mnt_ids={3: MNT_ID})
    inv = host.collector().collect()
    [hidden] = mount_of(inv, host.mounts[0]).hidden
    assert (
        hidden.name,
        hidden.cls,
        hidden.state,
        hidden.allocated_bytes,
        hidden.apparent_bytes,
        hidden.holders,
    ) == ("torch_9", "torch", "hidden", 12288, 12288, (100,))
    assert mount_of(inv, host.mounts[0]).process_bytes == {100: 12288}


class Failing(ProcessTable):
    """A process table whose walk fails while `failing` is set (a bug, EMFILE)."""

    failing = False

    def walk(self) -> ProcessWalk:
        if self.failing:
            raise OSError(24, "Too many open files")
        return super().walk()


def test_a_scan_that_fails_fails_the_run_and_the_next_quick_run_lists_again(
    host: Host,
) -> None:
    host.file(0, "psm_a")
    table = Failing(host.proc.paths)
    collector = host.collector(table)
    first = collector.collect()
    table.failing = True
    host.file(0, "psm_b")
    with pytest.raises(OSError):
        collector.collect()
    table.failing = False
    quick = (
        collector.collect_quick()
    )  # not the last inventory: its listing moved under it
    assert mount_of(quick, host.mounts[0]) is not mount_of(first, host.mounts[0])
    assert states(quick, host.mounts[0]) == {
        "psm_a": ("python_shm", "orphan", ()),
        "psm_b": ("python_shm", "linked", ()),
    }


def test_segments_named_any_bytes_are_listed(host: Host) -> None:
    name = os.fsdecode(b"psm_\xff\n")
    (Path(host.mounts[0]) / name).write_bytes(b"x")
    assert list(states(host.collector().collect(), host.mounts[0])) == [name]
    assert re.escape(name)


def test_a_quick_run_before_any_full_one_lists_the_mount(host: Host) -> None:
    host.file(0, "psm_a")
    host.holder(100, host.maps(0, "psm_a"))
    host.changes.add(host.mounts[0], "psm_a")
    inv = host.collector().collect_quick()  # an event came before the first full run
    assert states(inv, host.mounts[0]) == {"psm_a": ("python_shm", "linked", ())}
    assert (inv.pods, inv.memfd, inv.memfd_rest, inv.cgroup_of) == ({}, [], {}, {})


def test_a_sidecar_decides_every_run_whatever_the_full_scan_interval(
    host: Host,
) -> None:
    collector = host.collector(full_scan_interval=120.0, monotonic=lambda: 0.0)
    collector.collect()
    host.file(0, "psm_new")
    assert states(collector.collect(), host.mounts[0]) == {
        "psm_new": ("python_shm", "orphan", ())
    }


def test_an_excused_unreadable_process_leaves_orphans_provable(host: Host) -> None:
    host.file(0, "psm_a")
    host.holder(100, comm="process_api")
    host.proc.deny(100, "maps")
    strict = host.collector().collect()
    excused = host.collector(ignore_unreadable=re.compile("process_api")).collect()
    assert states(strict, host.mounts[0])["psm_a"][1] == "unverified"
    assert states(excused, host.mounts[0])["psm_a"][1] == (
        "orphan" if os.geteuid() == 0 else "unverified"
    )


def test_a_process_holding_several_segments_is_charged_for_each(
    host: Host, tmp_path: Path
) -> None:
    host.file(0, "nccl-a", 8192)
    host.file(0, "nccl-b", 4096)
    elsewhere = tmp_path / "unlinked"
    elsewhere.mkdir()
    with open(
        elsewhere / "torch_9 (deleted)", "wb"
    ) as f:  # sparse: 1 MiB asked, 12 KiB written
        f.truncate(1 << 20)
        f.write(b"x" * 12288)
    maps = host.maps(0, "nccl-a") + maps_line(
        0x40000, 0x41000, host.dev, host_ino(host, "nccl-b"), "/x/nccl-b"
    )
    host.holder(
        100, maps, fds={3: str(elsewhere / "torch_9 (deleted)")}, mnt_ids={3: MNT_ID}
    )
    m = mount_of(host.collector().collect(), host.mounts[0])
    assert m.process_bytes == {100: 8192 + 4096 + 12288}
    assert m.unattributed_bytes == max(
        0, m.used_bytes - (8192 + 4096 + 12288)
    )  # allocated, not asked
    [hidden] = m.hidden
    assert (hidden.allocated_bytes, hidden.apparent_bytes) == (12288, 1 << 20)


def host_ino(host: Host, name: str) -> int:
    return os.stat(Path(host.mounts[0]) / name).st_ino


def test_a_mapping_of_a_file_not_yet_listed_is_not_hidden(host: Host) -> None:
    """Created after the listing (not '(deleted)'): the next run lists it, linked."""
    host.holder(
        100,
        maps_line(
            0x1000, 0x2000, host.dev, 424242, os.path.join(host.mounts[0], "psm_later")
        ),
    )
    m = mount_of(host.collector().collect(), host.mounts[0])
    assert m.hidden == () and m.process_bytes == {}


def test_what_is_not_a_file_is_counted_by_kind(host: Host) -> None:
    root = Path(host.mounts[0])
    (root / "dir").mkdir()
    os.mkfifo(root / "fifo")
    os.symlink("/etc/shadow", root / "link")
    m = mount_of(host.collector().collect(), host.mounts[0])
    assert (
        m.other_entries == {"directory": 1, "fifo": 1, "symlink": 1} and m.names == ()
    )


def test_used_bytes_are_the_filesystems(tmp_path: Path) -> None:
    """A mount whose use does not move while read (/dev's devtmpfs): statvfs's used blocks."""
    proc = FakeProc(str(tmp_path / "proc"))
    proc.self_mountinfo([mountinfo_line(30, devno(os.stat("/dev").st_dev), "/dev")])
    inv = SegmentsCollector(proc.paths).collect(RunInput(mounts=("/dev",)))
    st = os.statvfs("/dev")
    [m] = inv.mounts
    assert m.used_bytes == (st.f_blocks - st.f_bfree) * st.f_frsize
    listed = sum(s.allocated_bytes for s in m.rows())
    assert m.unattributed_bytes == max(0, m.used_bytes - listed)


def test_a_degraded_mount_is_walked_whole_by_a_quick_run(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.collectors.segments")
    for i in range(4):
        host.file(0, f"psm_{i}", 4096)
    collector = host.collector(max_segments=3)
    collector.collect()
    host.file(0, "psm_9", 4096)
    host.changes.add(host.mounts[0], "psm_9")
    m = mount_of(collector.collect_quick(), host.mounts[0])
    assert (
        m.degraded
        == {
            "python_shm": ClassTotals(
                count=5, allocated_bytes=5 * 4096, apparent_bytes=5 * 4096
            )
        }
        and m.names == ()
    )
    assert [r.getMessage() for r in caplog.records] == [
        f"mount {host.mounts[0]}: more than 3 files (--inventory.max-segments): only their counts and bytes by "
        "class are kept, as 'unverified', until there are fewer"
    ]
    for i in range(3):
        os.unlink(Path(host.mounts[0]) / f"psm_{i}")
    collector.collect()
    assert (
        caplog.records[-1].getMessage()
        == f"mount {host.mounts[0]}: back under --inventory.max-segments"
    )


def test_a_scan_that_fails_on_the_first_run_fails_it(host: Host) -> None:
    table = Failing(host.proc.paths)
    table.failing = True
    with pytest.raises(OSError):
        host.collector(table).collect()


class Meanwhile(ProcessTable):
    """/proc read while the mount changes: `during()` runs as the scan walks the processes."""

    during: Optional[Callable[[], None]] = None

    def walk(self) -> ProcessWalk:
        if self.during is not None:
            self.during()
        return super().walk()


def test_what_changes_while_the_scan_reads_proc_is_not_called_leaked_by_it(
    host: Host,
) -> None:
    host.file(0, "psm_known", 4096)
    table = Meanwhile(host.proc.paths)
    collector = host.collector(table)
    assert states(collector.collect(), host.mounts[0])["psm_known"][1] == "orphan"

    def change() -> None:  # an attach writes to it, a new one is made: inotify says so
        (Path(host.mounts[0]) / "psm_known").write_bytes(b"y" * 8192)
        host.file(0, "psm_new")
        host.changes.add(host.mounts[0], "psm_known")
        host.changes.add(host.mounts[0], "psm_new")

    table.during = change
    inv = collector.collect()
    table.during = None
    assert (
        states(inv, host.mounts[0])["psm_known"][1] == "unverified"
    )  # its taker maybe read before
    assert "psm_new" not in states(inv, host.mounts[0])  # listed before it was made
    inv = collector.collect()
    assert {n: s[1] for n, s in states(inv, host.mounts[0]).items()} == {
        "psm_known": "orphan",
        "psm_new": "orphan",
    }


def test_used_bytes_are_the_filesystems_used_blocks(host: Host) -> None:
    """On the shared disk beneath the test, to within what others write meanwhile."""
    m = mount_of(host.collector().collect(), host.mounts[0])
    st = os.statvfs(host.mounts[0])
    assert abs(m.used_bytes - (st.f_blocks - st.f_bfree) * st.f_frsize) < 64 << 20


def test_a_mount_removed_while_proc_is_read_is_an_error(host: Host) -> None:
    host.file(0, "psm_a")
    table = Meanwhile(host.proc.paths)
    collector = host.collector(table)
    table.during = lambda: shutil.rmtree(host.mounts[0])  # a pod deleted meanwhile
    [m] = collector.collect().mounts
    assert m.error == "No such file or directory"
