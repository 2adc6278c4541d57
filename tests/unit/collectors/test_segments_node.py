# mypy: allow-untyped-calls, disable-error-code="abstract"
# (the modules are untyped; mypy reads Source.close()'s empty body as abstract)
"""Node mode's segment inventory: only a full scan of every process may call a segment leaked;
between full scans a refresh reads new processes and the pods whose mounts moved, and a new,
changed or written-to segment nobody is seen holding is not called leaked until the next full
scan. Pods' mounts are real directories at the kubelet's paths, processes a /proc tree.
Part of the mutation selection."""

import os
from pathlib import Path
from typing import Tuple

import pytest

from exporter.collectors.segments import SegmentsCollector
from exporter.collectors.source import REGISTRY, Context, RunInput
from exporter.config import parse_args
from exporter.host.proctable import ProcessTable
from exporter.model.types import Inventory
from tests.helpers import FakeProc, devno, maps_line, mountinfo_line
from tests.unit.collectors.test_segments import Host, mount_of, states

POD_A, POD_B = (
    "aaaaaaaa-1111-2222-3333-444444444444",
    "bbbbbbbb-1111-2222-3333-444444444444",
)


def kubelet(uid: str) -> str:
    return f"var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Node(Host):
    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, [kubelet(POD_A), kubelet(POD_B), "host-shm"])
        self.a, self.b, self.plain = self.mounts
        self.clock = Clock()
        self.watched = True
        self.file(0, "nccl-a")
        self.file(1, "nccl-b")
        self.holder(100, self.maps(0, "nccl-a"), cgroup=f"0::/kubepods/pod{POD_A}/c\n")
        self.holder(200, self.maps(1, "nccl-b"), cgroup=f"0::/kubepods/pod{POD_B}/c\n")
        self.segments = self.collector(
            pod_of_pid=True,
            full_scan_interval=120.0,
            monotonic=self.clock,
            all_watched=lambda: self.watched,
        )
        self.first = self.segments.collect()

    def run(self, after: float = 15.0) -> Tuple[bool, Inventory]:
        """A full run `after` seconds on: (whether it read every process, its inventory)."""
        self.clock.now += after
        before = self.segments.pace.scanned_at
        inv = self.segments.collect()
        return self.segments.pace.scanned_at != before, inv

    def created(self, mount: int, name: str, size: int = 8192) -> None:
        self.file(mount, name, size)
        self.changes.add(self.mounts[mount], name)

    def state(
        self, inv: Inventory, mount: int, name: str
    ) -> Tuple[str, Tuple[int, ...]]:
        return states(inv, self.mounts[mount])[name][1:]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_the_first_run_is_a_full_scan_that_knows_each_holders_pod(node: Node) -> None:
    assert node.state(node.first, 0, "nccl-a") == ("linked", (100,))
    assert node.first.pods == {100: POD_A, 200: POD_B}
    assert (
        node.segments.pace.scanned_at == 1000.0
        and node.segments.scans_beside_quick_runs  # its scan on a thread of its own
    )


def test_a_new_segment_nobody_holds_is_leaked_only_on_the_full_scans_word(
    node: Node,
) -> None:
    node.created(0, "psm_new")
    assert node.state(node.segments.collect_quick(), 0, "psm_new") == ("linked", ())
    scanned, inv = node.run(15)
    assert not scanned and node.state(inv, 0, "psm_new") == ("linked", ())  # a refresh
    scanned, inv = node.run(120)
    assert scanned and node.state(inv, 0, "psm_new") == ("orphan", ())
    assert node.segments.stretches is False  # one is called leaked


def test_an_orphan_written_through_a_mapping_is_not_called_leaked_before_a_full_scan(
    node: Node,
) -> None:
    node.file(0, "psm_orphan", 4096)
    _, inv = node.run(120)
    assert node.state(inv, 0, "psm_orphan") == ("orphan", ())
    (Path(node.a) / "psm_orphan").write_bytes(b"y" * 16384)  # pages written: no event
    scanned, inv = node.run(15)
    # Its pod was read again and nobody there holds it: the writer is outside the pod.
    assert not scanned and node.state(inv, 0, "psm_orphan") == ("unverified", ())
    scanned, inv = node.run(15)
    assert not scanned and node.state(inv, 0, "psm_orphan") == ("unverified", ())
    scanned, inv = node.run(120)
    assert scanned and node.state(inv, 0, "psm_orphan") == ("orphan", ())


def test_an_orphan_an_event_names_is_not_called_leaked_before_its_pod_is_read(
    node: Node,
) -> None:
    node.file(1, "psm_orphan", 4096)
    _, inv = node.run(120)
    node.changes.add(node.b, "psm_orphan")  # touched (attributes, an attach)
    quick = node.segments.collect_quick()
    assert node.state(quick, 1, "psm_orphan") == ("unverified", ())
    node.holder(201, node.maps(1, "psm_orphan"), cgroup=f"0::/kubepods/pod{POD_B}/c\n")
    scanned, inv = node.run(15)  # the refresh reads new processes: 201 holds it
    assert not scanned and node.state(inv, 1, "psm_orphan") == ("linked", (201,))


def test_a_holder_that_exits_leaves_its_segment_unverified_until_a_full_scan(
    node: Node,
) -> None:
    os.rename(node.proc.path(100), node.proc.path("100-gone"))
    scanned, inv = node.run(15)
    assert not scanned and node.state(inv, 0, "nccl-a") == ("unverified", ())
    scanned, inv = node.run(120)
    assert scanned and node.state(inv, 0, "nccl-a") == ("orphan", ())


def test_an_orphan_written_in_no_pods_mount_brings_the_full_scan_forward(
    node: Node,
) -> None:
    node.file(2, "psm_host", 4096)
    node.run(120)
    (Path(node.plain) / "psm_host").write_bytes(b"y" * 16384)
    scanned, inv = node.run(15)
    assert scanned and node.state(inv, 2, "psm_host") == ("orphan", ())


def test_with_a_mount_inotify_does_not_watch_the_scan_keeps_its_base(
    node: Node,
) -> None:
    node.watched = False
    assert node.segments.stretches is False
    for _ in range(3):
        assert node.run(120)[0]


def test_a_staged_full_run_leaves_what_changed_meanwhile_unsettled(node: Node) -> None:
    node.file(0, "psm_old", 4096)
    node.run(120)
    node.clock.now += 120
    assert (
        node.segments.scans_beside_quick_runs
    )  # node mode reads /proc on a thread of its own
    staged = node.segments.begin_full()
    staged.scan()  # reads /proc (beside quick runs)
    node.created(0, "psm_during")  # listed by a quick run while the scan read /proc
    quick = node.segments.collect_quick()
    assert node.state(quick, 0, "psm_during") == ("linked", ())
    inv = node.segments.finish(staged)
    assert node.state(inv, 0, "psm_during") == (
        "linked",
        (),
    )  # the scan may have missed its taker
    assert node.state(inv, 0, "nccl-a") == ("linked", (100,))
    assert node.state(inv, 0, "psm_old") == (
        "orphan",
        (),
    )  # unchanged meanwhile: settled
    scanned, inv = node.run(120)
    assert scanned and node.state(inv, 0, "psm_during") == ("orphan", ())


def test_a_mount_gone_is_dropped_and_one_back_is_listed_anew(node: Node) -> None:
    os.rename(node.b, node.b + ".away")
    _, inv = node.run(120)
    assert mount_of(inv, node.b).error == "No such file or directory"
    os.rename(node.b + ".away", node.b)
    _, inv = node.run(15)
    assert node.state(inv, 1, "nccl-b") == ("linked", (200,))


def test_holders_pods_are_known_between_full_scans(node: Node) -> None:
    node.holder(300, node.maps(1, "nccl-b"), cgroup=f"0::/kubepods/pod{POD_B}/d\n")
    scanned, inv = node.run(15)
    assert not scanned and inv.pods == {100: POD_A, 200: POD_B, 300: POD_B}
    quick = node.segments.collect_quick()
    assert quick.pods == inv.pods


def test_only_the_orphan_written_to_is_doubted(node: Node) -> None:
    node.file(0, "psm_x", 4096)
    node.file(0, "psm_y", 4096)
    node.run(120)
    (Path(node.a) / "psm_x").write_bytes(b"y" * 16384)
    _, inv = node.run(15)
    assert (node.state(inv, 0, "psm_x"), node.state(inv, 0, "psm_y")) == (
        ("unverified", ()),
        ("orphan", ()),
    )
    scanned, inv = node.run(120)
    assert scanned and node.state(inv, 0, "psm_x") == ("orphan", ())
    scanned, inv = node.run(15)  # nothing written since the full scan read its pod
    assert (
        not scanned
        and (node.state(inv, 0, "psm_x"), node.state(inv, 0, "psm_y"))
        == (("orphan", ()),) * 2
    )


def test_a_running_process_that_attaches_to_an_orphan_is_seen_by_the_next_refresh(
    node: Node,
) -> None:
    node.file(0, "psm_x", 4096)
    node.holder(
        101, cgroup=f"0::/kubepods/pod{POD_A}/c\n"
    )  # in pod A since the full scan
    node.run(120)
    node.proc.write("101/maps", node.maps(0, "psm_x"))
    (Path(node.a) / "psm_x").write_bytes(b"y" * 16384)  # and writes through the mapping
    scanned, inv = node.run(15)
    assert not scanned and node.state(inv, 0, "psm_x") == ("linked", (101,))


def test_a_create_beside_an_orphan_does_not_doubt_the_orphan(node: Node) -> None:
    node.file(0, "psm_x", 4096)
    node.run(120)
    node.created(0, "psm_new")
    quick = node.segments.collect_quick()
    assert (node.state(quick, 0, "psm_x"), node.state(quick, 0, "psm_new")) == (
        ("orphan", ()),
        ("linked", ()),
    )
    _, inv = node.run(15)
    assert node.state(inv, 0, "psm_x") == ("orphan", ())


def test_a_change_pending_when_a_staged_scan_begins_is_not_settled_by_it(
    node: Node,
) -> None:
    node.created(0, "psm_pending")  # named by inotify, not yet listed by a quick run
    node.clock.now += 120
    staged = node.segments.begin_full()
    staged.scan()
    inv = node.segments.finish(staged)
    assert node.state(inv, 0, "psm_pending") == ("linked", ())
    scanned, inv = node.run(120)
    assert scanned and node.state(inv, 0, "psm_pending") == ("orphan", ())


def context(tmp_path: Path, *argv: str) -> Context:
    cfg = parse_args([f"--path.procfs={tmp_path / 'proc'}", *argv])
    proc = FakeProc(str(tmp_path / "proc"))
    return Context(cfg=cfg, paths=proc.paths, table=ProcessTable(proc.paths))


def test_the_registered_collector_takes_its_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(
        "SHMWATCH_SEGMENTS_IGNORE_UNREADABLE", raising=False
    )  # tests/conftest.py's
    node_ctx = context(
        tmp_path,
        "--mode=node",
        "--segments.full-scan-interval=3m",
        "--inventory.max-segments=7",
    )
    made = REGISTRY["segments"].factory(node_ctx)
    assert isinstance(made, SegmentsCollector)
    stretches = made.stretches(RunInput(all_watched=True))
    assert (made.pod_of_pid, made.pace.every, made.max_segments, stretches) == (
        True,
        180.0,
        7,
        True,
    )
    assert made.table is node_ctx.table and made.scans_beside_quick_runs
    sidecar = REGISTRY["segments"].factory(
        context(tmp_path / "s", "--segments.ignore-unreadable=^agent$")
    )
    assert isinstance(sidecar, SegmentsCollector)
    assert (sidecar.pod_of_pid, sidecar.pace.every, sidecar.max_segments) == (
        False,
        0.0,
        150_000,
    )
    scan = sidecar.owner_scan
    assert (
        scan.ignore_unreadable is not None
        and scan.ignore_unreadable.pattern == "^agent$"
    )
    unset = REGISTRY["segments"].factory(context(tmp_path / "t"))
    assert (
        isinstance(unset, SegmentsCollector)
        and unset.owner_scan.ignore_unreadable is None
    )


def test_an_event_naming_one_orphan_doubts_that_one_only(node: Node) -> None:
    node.file(0, "psm_x", 4096)
    node.file(0, "psm_y", 4096)
    node.run(120)
    node.created(0, "psm_new")
    node.changes.add(
        node.a, "psm_x"
    )  # its attributes changed: someone may have attached
    quick = node.segments.collect_quick()
    states_now = {n: node.state(quick, 0, n)[0] for n in ("psm_x", "psm_y", "psm_new")}
    assert states_now == {"psm_x": "unverified", "psm_y": "orphan", "psm_new": "linked"}


def test_a_change_below_a_pods_mount_doubts_every_orphan_there(node: Node) -> None:
    node.file(0, "psm_x", 4096)
    node.run(120)
    node.changes.unknown(node.a)  # a sub-directory changed: any name may have
    assert node.state(node.segments.collect_quick(), 0, "psm_x") == ("unverified", ())


def test_the_full_scan_stretches_while_nothing_changes_and_is_back_to_its_base_on_a_change(
    tmp_path: Path,
) -> None:
    """On a mount whose figures hold still (/dev), holders alike: 120 s, 240, 480, then 960
    (8 x 120) at most; a new holder brings the base back."""
    proc = FakeProc(str(tmp_path / "proc"))
    proc.self_links(pid_ns=f"pid:[{0xEFFFFFFC}]")
    dev = os.stat("/dev").st_dev
    proc.self_mountinfo([mountinfo_line(30, devno(dev), "/dev")])
    proc.add(
        50, mountinfo=mountinfo_line(30, devno(dev), "/dev")
    )  # a process, holding nothing
    clock = Clock()
    segments = SegmentsCollector(
        proc.paths,
        pod_of_pid=True,
        full_scan_interval=120.0,
        monotonic=clock,
    )

    def full_run(after: float) -> bool:
        clock.now += after
        before = segments.pace.scanned_at
        segments.collect(RunInput(mounts=("/dev",), all_watched=True))
        return segments.pace.scanned_at != before

    assert full_run(0) and full_run(120)  # nothing to compare the first with
    for gap in (240, 480, 960, 960):
        assert not full_run(gap - 1)
        assert full_run(1)
    null = os.stat("/dev/null")
    proc.add(
        100,
        maps=maps_line(0x1000, 0x2000, dev, null.st_ino, "/dev/null"),
        mountinfo=mountinfo_line(30, devno(dev), "/dev"),
    )
    assert not full_run(119)  # a refresh reads the new process: a change
    assert full_run(1)
