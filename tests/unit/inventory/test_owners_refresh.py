# mypy: allow-untyped-calls
"""Node mode's owner scan between full scans (OwnerScan.refresh): new processes and the pods
of exited holders are read, every other holding carries over (never turned orphan unread);
what cannot be scoped (a holder outside any pod exited, pids wrapped) asks for a full scan.
And processes that start while a scan reads /proc. A /proc tree (tests/helpers.FakeProc)
and real files: fast, part of the mutation-testing selection."""

import os
import shutil
from pathlib import Path
from typing import AbstractSet, List, Optional

import pytest

from exporter.host.proctable import ProcessTable
from exporter.inventory.holdings import Owners
from exporter.inventory.owners import MAX_PASSES, OwnerScan
from tests.helpers import FakeProc, maps_line
from tests.unit.inventory.test_owners import MNT_ID, World

POD_A = "aaaaaaaa-1111-2222-3333-444444444444"
POD_B = "bbbbbbbb-1111-2222-3333-444444444444"


def in_pod(uid: str) -> str:
    return f"4:memory:/kubepods/burstable/pod{uid}/c0ffee\n"


class Node:
    """Two pods' processes and one on the host, each segment mapped by its holder."""

    def __init__(self, tmp_path: Path) -> None:
        shm = tmp_path / "shm"
        shm.mkdir()
        proc = FakeProc(str(tmp_path / "proc"))
        proc.self_links(pid_ns=f"pid:[{0xEFFFFFFC}]")
        self.world = World(shm, proc, os.stat(shm).st_dev)
        self.keys = {
            name: self.world.segment(name) for name in ("nccl-a", "nccl-b", "nccl-h")
        }
        self.hold(100, "nccl-a", cgroup=in_pod(POD_A))
        self.hold(101, None, cgroup=in_pod(POD_A))
        self.hold(200, "nccl-b", cgroup=in_pod(POD_B))
        self.hold(300, "nccl-h", cgroup="4:memory:/system.slice/x.service\n")
        self.scanner = OwnerScan(ProcessTable(proc.paths))
        self.devs = {self.world.dev}
        self.owners = self.scanner.scan(self.devs, pods=True)

    def maps(self, name: Optional[str]) -> str:
        if name is None:
            return ""
        return maps_line(
            0x1000,
            0x2000,
            self.world.dev,
            self.keys[name][1],
            str(self.world.shm / name),
        )

    def hold(self, pid: int, name: Optional[str], cgroup: str = "") -> None:
        self.world.add(pid, cgroup=cgroup, maps=self.maps(name))

    def remap(self, pid: int, name: Optional[str]) -> None:
        self.world.proc.write(f"{pid}/maps", self.maps(name))

    def exit(self, pid: int) -> None:
        shutil.rmtree(self.world.proc.path(pid))

    def holders(self, owners: Owners, name: str) -> List[int]:
        return sorted(h.pid for h in owners.holdings.get(self.keys[name], []))

    def refresh(self, also: AbstractSet[str] = frozenset()) -> Owners:
        owners = self.scanner.refresh(self.devs, self.owners, also=set(also))
        assert owners is not None, "a full scan asked for"
        return owners

    def asks_for_a_full_scan(self) -> bool:
        return self.scanner.refresh(self.devs, self.owners) is None


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_the_full_scan_knows_each_holders_pod(node: Node) -> None:
    assert node.owners.pod_of == {100: POD_A, 200: POD_B, 300: ""}
    assert [node.holders(node.owners, n) for n in ("nccl-a", "nccl-b", "nccl-h")] == [
        [100],
        [200],
        [300],
    ]


def test_with_nothing_new_a_refresh_carries_every_holding_over(node: Node) -> None:
    node.remap(200, None)  # unread by a refresh: pod B is not read again
    owners = node.refresh()
    assert [node.holders(owners, n) for n in ("nccl-a", "nccl-b", "nccl-h")] == [
        [100],
        [200],
        [300],
    ]
    assert sorted(owners.holders) == [100, 200, 300] and owners.complete
    assert (owners.unreadable, owners.unverifiable) == (0, 0)
    assert owners.comms == node.owners.comms and owners.scanned == node.owners.scanned
    # the full scan's index is left as it was
    assert node.holders(node.owners, "nccl-b") == [200]


def test_a_new_process_is_read_and_its_pod_known(node: Node) -> None:
    node.hold(400, "nccl-a", cgroup=in_pod(POD_A))
    owners = node.refresh()
    assert node.holders(owners, "nccl-a") == [100, 400]
    assert owners.pod_of[400] == POD_A and owners.comms[400] == "python3"
    assert 400 in owners.processes and owners.keys_of[400] == [node.keys["nccl-a"]]


def test_a_holder_that_exited_has_its_pod_read_again(node: Node) -> None:
    node.exit(100)
    node.remap(101, "nccl-a")  # its pod's other process holds it now
    node.remap(200, None)  # another pod: carried over unread
    owners = node.refresh()
    assert node.holders(owners, "nccl-a") == [101]
    assert node.holders(owners, "nccl-b") == [200]
    assert 100 not in owners.processes and 100 not in owners.holders
    assert owners.pod_of[101] == POD_A


def test_a_pod_named_is_read_again(node: Node) -> None:
    node.remap(200, None)
    owners = node.refresh(also={POD_B})
    assert node.holders(owners, "nccl-b") == [] and 200 not in owners.holders
    assert node.holders(owners, "nccl-a") == [100]


def test_a_holder_outside_any_pod_that_exits_asks_for_a_full_scan(node: Node) -> None:
    node.exit(300)
    assert node.asks_for_a_full_scan()


def test_a_holder_of_nothing_watched_outside_any_pod_may_exit(node: Node) -> None:
    memfd = maps_line(0x1000, 0x2000, os.makedev(0, 1), 9, "/memfd:x (deleted)")
    node.world.add(
        500, maps=memfd
    )  # a memfd alone (runc's): waits for the next full scan
    node.owners = node.scanner.scan(node.devs, pods=True)
    node.exit(500)
    owners = node.refresh()
    assert owners is not None and 500 not in owners.processes


def test_pids_that_may_have_wrapped_ask_for_a_full_scan(node: Node) -> None:
    node.world.proc.counters(last_pid=200, pid_max=4194304, forks=1000)  # went down
    assert node.asks_for_a_full_scan()


def test_more_forks_than_pids_ask_for_a_full_scan(node: Node) -> None:
    node.world.proc.counters(
        last_pid=400, pid_max=1300, forks=2000
    )  # 1000 more: >= 1300 - 300
    assert node.asks_for_a_full_scan()


def test_unknown_pid_counters_ask_for_a_full_scan(node: Node) -> None:
    os.unlink(node.world.proc.path("sys", "kernel", "ns_last_pid"))
    assert node.asks_for_a_full_scan()


def test_fewer_forks_than_pids_is_no_wrap(node: Node) -> None:
    node.world.proc.counters(
        last_pid=400, pid_max=1301, forks=1999
    )  # 999 more: < 1301 - 300
    assert not node.asks_for_a_full_scan()


def test_a_new_process_that_cannot_be_read_leaves_nothing_provable(node: Node) -> None:
    node.world.add(600)
    os.unlink(node.world.proc.path(600, "stat"))
    os.mkdir(node.world.proc.path(600, "stat"))
    owners = node.refresh()
    assert (owners.unreadable, owners.unverifiable, owners.complete) == (
        None,
        None,
        False,
    )
    assert owners.unproven == ["1 new process(es) whose stat could not be read"]
    assert node.holders(owners, "nccl-a") == [100]


def test_refreshes_chain_without_repeating_their_reasons(node: Node) -> None:
    node.world.add(600)
    os.unlink(node.world.proc.path(600, "stat"))
    os.mkdir(node.world.proc.path(600, "stat"))
    node.owners = node.refresh()
    again = node.refresh()
    assert again.unproven == ["1 new process(es) whose stat could not be read"]


def test_an_fd_held_by_a_new_process_in_a_mount_namespace_of_its_own(
    node: Node,
) -> None:
    torch = node.world.segment("torch_7")
    node.world.add(
        700,
        fds={4: str(node.world.shm / "torch_7")},
        mnt_ids={4: MNT_ID},
        mnt_ns="mnt:[4026532999]",
    )
    owners = node.refresh()
    assert sorted(h.pid for h in owners.holdings[torch]) == [700]


class Forking(ProcessTable):
    """/proc where, each time the pids are listed again, a new process appears that maps
    nccl-a (`forks`: how many times at most): a holder's child while a scan reads."""

    def __init__(self, node: Node, forks: int) -> None:
        super().__init__(node.world.proc.paths)
        self.node, self.forks, self.listed = node, forks, 0

    def pids(self) -> List[int]:
        if self.listed and self.forks:
            self.forks -= 1
            self.node.hold(800 + self.listed, "nccl-a", cgroup=in_pod(POD_A))
        self.listed += 1
        return super().pids()


def test_a_child_started_while_the_scan_reads_is_read_in_another_pass(
    node: Node,
) -> None:
    owners = OwnerScan(Forking(node, forks=2)).scan(node.devs)
    assert node.holders(owners, "nccl-a") == [100, 801, 802] and owners.complete


def test_processes_that_keep_starting_leave_nothing_provable(node: Node) -> None:
    owners = OwnerScan(Forking(node, forks=MAX_PASSES)).scan(node.devs)
    assert node.holders(owners, "nccl-a") == [
        100,
        801,
        802,
        803,
    ]  # 804: listed, never read
    assert (owners.unverifiable, owners.complete) == (None, False)
    assert owners.unproven == [f"processes kept starting over {MAX_PASSES} passes"]


def test_a_segment_two_pods_hold_keeps_the_holder_whose_pod_is_not_read(
    node: Node,
) -> None:
    node.remap(200, "nccl-a")  # pod B's process maps pod A's segment too
    node.owners = node.scanner.scan(node.devs, pods=True)
    node.remap(100, None)
    owners = node.refresh(also={POD_A})
    assert node.holders(owners, "nccl-a") == [200]
    node.remap(100, "nccl-a")
    node.remap(200, None)
    owners = node.refresh(also={POD_B})
    assert node.holders(owners, "nccl-a") == [100]


def test_an_exited_process_is_forgotten_by_the_refresh_after(node: Node) -> None:
    node.exit(100)
    node.owners = node.refresh()  # reads pod A: learns 101's pod
    assert node.owners.pod_of[101] == POD_A
    node.exit(101)
    owners = node.refresh()
    assert 101 not in owners.pod_of and 101 not in owners.processes


def test_a_refresh_after_a_mount_came_reads_its_holders(
    node: Node, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    node.hold(400, "nccl-a", cgroup=in_pod(POD_A))
    owners = node.scanner.refresh(node.devs | {node.world.dev + 1}, node.owners)
    assert owners is not None and node.holders(owners, "nccl-a") == [100, 400]


def test_a_new_process_holding_an_fd_passed_from_a_pods_namespace(node: Node) -> None:
    torch = node.world.segment("torch_9")
    node.world.add(
        900, mountinfo="", fds={4: str(node.world.shm / "torch_9")}, mnt_ids={4: MNT_ID}
    )
    owners = node.refresh()
    assert sorted(h.pid for h in owners.holdings[torch]) == [900]
