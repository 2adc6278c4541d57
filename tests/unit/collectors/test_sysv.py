# mypy: allow-untyped-calls, disable-error-code="abstract"
# (the modules are untyped; mypy reads Source.close()'s empty body as abstract)
"""SysV shared memory on a /proc tree: which segments are orphans (nothing attached, creator
and last user gone: `ipcrm` advice follows), never one whose creator we cannot see (pid 0:
another PID namespace) or that hidepid hides; the kernel's limits; node mode's namespaces,
whose they are, and the ones that cannot be read; how /proc hides pids read once a run, not
once per namespace (real IPC namespaces, as root). Fast: part of the mutation selection."""

import ctypes
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exporter.collectors.source import RunInput
from exporter.collectors.sysv import IpcNamespace, SysvCollector, in_ipc_namespaces, parse_sysvipc_shm
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from exporter.model.types import SysvSegment, SysvShm
from tests.conftest import IS_ROOT, needs_root, prerequisite_missing
from tests.helpers import FakeProc, any_text, fixture

HEADER = "       key      shmid perms       size  cpid  lpid nattch   uid   gid  cuid  cgid      atime      dtime      ctime        rss       swap\n"
NEVER = 4194305  # above PID_MAX_LIMIT: no such process, ever
POD = "0a0b0c0d-1111-2222-3333-444455556666"
CONTAINER = "ab" * 32


def shm_line(
    key: int, shmid: int, size: int, cpid: int, lpid: int, nattch: int, rss: int = 4096
) -> str:
    return f"{key:>10} {shmid:>10} 1600 {size:>10} {cpid:>5} {lpid:>5} {nattch:>6} 0 0 0 0 0 0 0 {rss:>10} 0\n"


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    tree = FakeProc(str(tmp_path / "proc"))
    tree.write("sys/kernel/shmmax", "18446744073692774399\n")
    tree.write("sys/kernel/shmall", "4194304\n")
    tree.write("sys/kernel/shmmni", "4096\n")
    return tree


def read(proc: FakeProc, *lines: str) -> SysvShm:
    proc.write("sysvipc/shm", HEADER + "".join(lines))
    [shm] = SysvCollector(
        proc.paths, page_size=4096
    ).collect()  # a sidecar: its own namespace
    return shm


def orphans(shm: SysvShm) -> List[int]:
    return [s.shmid for s in shm.segments if s.orphan]


def test_an_orphan_has_nothing_attached_and_its_creator_and_last_user_gone(
    proc: FakeProc,
) -> None:
    alive = os.getpid()
    shm = read(
        proc,
        shm_line(
            1, 10, 8 << 20, cpid=NEVER, lpid=0, nattch=0
        ),  # never attached, creator gone
        shm_line(2, 11, 4096, cpid=NEVER, lpid=NEVER + 1, nattch=0),  # both gone
        shm_line(3, 12, 4096, cpid=NEVER, lpid=NEVER + 1, nattch=1),  # attached
        shm_line(4, 13, 4096, cpid=alive, lpid=0, nattch=0),  # creator alive
        shm_line(5, 14, 4096, cpid=NEVER, lpid=alive, nattch=0),  # last user alive
    )
    assert orphans(shm) == [10, 11]
    assert shm.segments[0] == SysvSegment(
        1, 10, 8 << 20, 0, NEVER, 4096, 0, orphan=True
    )


def test_a_creator_in_another_pid_namespace_is_not_gone(proc: FakeProc) -> None:
    """The kernel prints 0 for a pid outside the reader's PID namespace: unknown, so the
    segment is no orphan and gets no ipcrm advice (the issue's planted bug)."""
    shm = read(
        proc,
        shm_line(1, 10, 4096, cpid=0, lpid=0, nattch=0),
        shm_line(2, 11, 4096, cpid=NEVER, lpid=0, nattch=0),
    )
    assert orphans(shm) == [11]
    shm = read(proc, shm_line(1, 10, 4096, cpid=NEVER, lpid=0, nattch=0))
    assert orphans(shm) == [10]
    shm = read(proc, shm_line(1, 10, 4096, cpid=-1, lpid=0, nattch=0))
    assert orphans(shm) == []


def test_under_hidepid_only_a_pid_that_does_not_exist_is_gone(proc: FakeProc) -> None:
    """hidepid hides live creators from /proc: kill(pid, 0) tells (ESRCH: gone)."""
    proc.self_mountinfo(hidepid="2")
    me = os.getpid()  # alive, though not in this /proc
    shm = read(
        proc,
        shm_line(1, 10, 4096, cpid=me, lpid=0, nattch=0),
        shm_line(2, 11, 4096, cpid=NEVER, lpid=0, nattch=0),
        shm_line(3, 12, 4096, cpid=NEVER, lpid=me, nattch=0),
        shm_line(4, 13, 4096, cpid=NEVER, lpid=NEVER, nattch=0),
    )
    assert orphans(shm) == [11, 13]


@pytest.mark.parametrize("hidepid", ["0", None])
def test_a_live_pid_missing_from_proc_is_not_gone_whatever_the_mount_says(
    tmp_path: Path, hidepid: Optional[str]
) -> None:
    """hidepid=0 in mountinfo, or no mountinfo at all (how /proc hides pids unknown): a pid
    /proc does not list is not gone while kill(pid, 0) finds it. The bug: a missing /proc
    entry was taken for an exit unless mountinfo said hidepid, and an unread mountinfo said
    "off": a hidden live creator's segment was called an orphan, ipcrm advised."""
    tree = FakeProc(str(tmp_path / "proc"), hidepid=hidepid)
    tree.write("sys/kernel/shmmni", "4096\n")
    for live in (os.getpid(), 1):
        assert (
            orphans(read(tree, shm_line(1, 10, 4096, cpid=live, lpid=0, nattch=0)))
            == []
        )
    assert orphans(read(tree, shm_line(1, 10, 4096, cpid=NEVER, lpid=0, nattch=0))) == [
        10
    ]


def test_telling_a_creator_alive_signals_nothing(proc: FakeProc) -> None:
    """kill(pid, 0) probes; any other signal would reach the server."""
    child = os.fork()
    if child == 0:  # dies with the test, whatever happens to it
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        signal.pause()
        os._exit(0)
    try:
        proc.self_mountinfo(hidepid="2")
        assert (
            orphans(read(proc, shm_line(1, 10, 4096, cpid=child, lpid=0, nattch=0)))
            == []
        )
        assert os.waitpid(child, os.WNOHANG) == (0, 0)  # still there
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_the_kernels_limits_shmall_in_pages(proc: FakeProc) -> None:
    shm = read(proc)
    assert (shm.shmmax_bytes, shm.shmall_bytes, shm.shmmni) == (
        18446744073692774399,
        4194304 * 4096,
        4096,
    )
    assert (shm.segments, shm.readable, shm.namespace) == ([], True, "")


def test_limits_that_cannot_be_read_are_unknown(proc: FakeProc) -> None:
    os.unlink(proc.path("sys", "kernel", "shmall"))
    proc.write("sys/kernel/shmmni", "\n")
    proc.write("sys/kernel/shmmax", "lots\n")
    shm = read(proc)
    assert (shm.shmmax_bytes, shm.shmall_bytes, shm.shmmni) == (None, None, None)


def test_a_sidecar_reads_its_own_namespace(proc: FakeProc) -> None:
    proc.write(
        "sysvipc/shm", HEADER + shm_line(1, 10, 4096, cpid=NEVER, lpid=0, nattch=0)
    )
    collector = SysvCollector(proc.paths, page_size=4096)
    [shm] = collector.collect()
    assert (orphans(shm), shm.namespace, shm.readable) == ([10], "", True)
    assert (collector.schedule, collector.stretches(RunInput())) == ("poll", False)
    node = SysvCollector(proc.paths, page_size=4096, node_mode=True)
    assert (node.schedule, node.stretches(RunInput())) == ("inventory", True)


def test_a_missing_sysvipc_file_fails_the_sidecars_collector(proc: FakeProc) -> None:
    with pytest.raises(FileNotFoundError):
        SysvCollector(proc.paths).collect()


def own_namespace() -> str:
    return os.readlink(f"/proc/{os.getpid()}/ns/ipc")


def needs_setns() -> None:
    if not IS_ROOT:
        prerequisite_missing("needs root (CAP_SYS_ADMIN) to join an IPC namespace")


def test_in_ipc_namespaces_reads_in_each_and_skips_paths_gone() -> None:
    needs_setns()
    mine = own_namespace()
    got = in_ipc_namespaces(
        [
            IpcNamespace(
                namespace=mine,
                links=["/nonexistent/ns/ipc", f"/proc/{os.getpid()}/ns/ipc"],
            )
        ],
        lambda: "read",
    )
    assert got == {mine: "read"}
    # a path whose namespace is not the one asked for is not joined
    assert (
        in_ipc_namespaces(
            [IpcNamespace(namespace="ipc:[1]", links=[f"/proc/{os.getpid()}/ns/ipc"])],
            lambda: "read",
        )
        == {}
    )


def in_a_new_ipc_namespace() -> Tuple[str, str, threading.Event]:
    """A thread of this process in an IPC namespace of its own (unshare moves only the calling
    thread): (its ns/ipc path, the namespace, the event that ends it)."""
    ready, done, where = threading.Event(), threading.Event(), []

    def run() -> None:
        if ctypes.CDLL(None, use_errno=True).unshare(0x08000000) == 0:  # CLONE_NEWIPC
            tid = threading.get_native_id()
            path = f"/proc/{os.getpid()}/task/{tid}/ns/ipc"
            where.append((path, os.readlink(path)))
        ready.set()
        done.wait(10)

    threading.Thread(target=run, daemon=True).start()
    ready.wait(10)
    assert where, "unshare(CLONE_NEWIPC) failed"
    return (*where[0], done)


def test_in_ipc_namespaces_reads_each_namespace_from_within_it() -> None:
    needs_setns()
    path, other, done = in_a_new_ipc_namespace()
    mine = own_namespace()
    try:
        where = lambda: os.readlink(
            f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/ipc"
        )  # noqa: E731
        got = in_ipc_namespaces(
            [
                IpcNamespace(namespace=mine, links=[f"/proc/{os.getpid()}/ns/ipc"]),
                IpcNamespace(namespace=other, links=[path]),
            ],
            where,
        )
    finally:
        done.set()
    assert got == {mine: mine, other: other} and mine != other


def test_in_ipc_namespaces_hands_back_errors_and_bounds_the_time() -> None:
    needs_setns()
    mine = own_namespace()

    def fails() -> None:
        raise ValueError("sysvipc/shm: unexpected header")

    [(namespace, error)] = in_ipc_namespaces(
        [IpcNamespace(namespace=mine, links=[f"/proc/{os.getpid()}/ns/ipc"])], fails
    ).items()
    assert (
        namespace == mine
        and isinstance(error, ValueError)
        and error.__traceback__ is None
    )
    started = time.monotonic()
    late = in_ipc_namespaces(
        [IpcNamespace(namespace=mine, links=[f"/proc/{os.getpid()}/ns/ipc"])],
        lambda: time.sleep(1),
        timeout=0.05,
    )
    assert time.monotonic() - started < 0.5
    assert isinstance(late[mine], TimeoutError)
    assert str(late[mine]) == f"reading IPC namespace {mine} took over 0.05s"
    # The reader left behind never holds shmwatch's exit, and says what it is in a stack dump.
    [left] = [t for t in threading.enumerate() if t.name == "shmwatch-sysv-ns"]
    assert left.daemon


class Node:
    """Node mode's /proc: processes whose ns/ipc is this test's own (real) namespace, seen as
    another's; shmwatch's own namespace a fixture one."""

    def __init__(self, proc: FakeProc) -> None:
        self.proc = proc
        proc.write(
            "sysvipc/shm", HEADER + shm_line(1, 10, 4096, cpid=NEVER, lpid=0, nattch=0)
        )
        os.makedirs(proc.path("self", "ns"))
        os.symlink("ipc:[1]", proc.path("self", "ns", "ipc"))
        self.real = own_namespace()

    def process(self, pid: int, cgroup: str = "", shared: bool = True) -> None:
        self.proc.add(pid, cgroup=cgroup)
        if shared:  # in the real namespace
            os.symlink(f"/proc/{os.getpid()}/ns", self.proc.path(pid, "ns"))
        else:  # in shmwatch's own
            os.makedirs(self.proc.path(pid, "ns"))
            os.symlink("ipc:[1]", self.proc.path(pid, "ns", "ipc"))

    def collect(self) -> List[SysvShm]:
        return SysvCollector(self.proc.paths, page_size=4096, node_mode=True).collect()


def test_node_mode_reads_each_namespace_and_names_its_pod(proc: FakeProc) -> None:
    needs_setns()
    node = Node(proc)
    node.process(100, cgroup=f"0::/kubepods/burstable/pod{POD}/{CONTAINER}\n")
    node.process(101, cgroup=f"0::/kubepods/burstable/pod{POD}/{'cd' * 32}\n")
    node.process(os.getpid(), shared=False)  # shmwatch alone in its own: not reported
    [shm] = node.collect()
    assert (shm.namespace, shm.pod_uid, shm.container_id, shm.readable) == (
        node.real,
        POD,
        "",
        True,
    )
    assert orphans(shm) == [10] and shm.shmmni == 4096


def test_node_mode_names_a_namespace_outside_any_pod_by_its_container(
    proc: FakeProc,
) -> None:
    needs_setns()
    node = Node(proc)
    node.process(100, cgroup=f"12:memory:/docker/{CONTAINER}\n0::/docker/{CONTAINER}\n")
    node.process(101, cgroup="0::/system.slice/sshd.service\n")
    [shm] = node.collect()
    assert (shm.pod_uid, shm.container_id) == ("", CONTAINER)
    # the memory controller's path first (v1), else the unified one's
    proc.write("100/cgroup", f"12:memory:/docker/{CONTAINER}\n0::/init.scope\n")
    assert node.collect()[0].container_id == CONTAINER
    proc.write("100/cgroup", f"0::/system.slice/docker-{'ef' * 32}.scope\n")
    assert node.collect()[0].container_id == "ef" * 32
    os.unlink(proc.path(100, "cgroup"))
    assert node.collect()[0].container_id == ""


def test_node_mode_names_no_pod_for_a_namespace_two_pods_share(proc: FakeProc) -> None:
    needs_setns()
    node = Node(proc)
    node.process(100, cgroup=f"0::/kubepods/burstable/pod{POD}/{CONTAINER}\n")
    node.process(
        101,
        cgroup=f"0::/kubepods/burstable/pod{'1' * 8}-2222-3333-4444-555555555555/{'cd' * 32}\n",
    )
    [shm] = node.collect()
    assert (shm.pod_uid, shm.container_id) == ("", CONTAINER)


def test_node_mode_reports_shmwatchs_namespace_when_others_share_it(
    proc: FakeProc,
) -> None:
    node = Node(proc)
    node.process(os.getpid(), shared=False)
    node.process(300, cgroup="0::/system.slice/x.service\n", shared=False)
    [shm] = node.collect()
    assert (shm.namespace, shm.pod_uid, shm.container_id, orphans(shm)) == (
        "ipc:[1]",
        "",
        "",
        [10],
    )


def test_node_mode_says_which_namespace_could_not_be_read(proc: FakeProc) -> None:
    node = Node(proc)
    node.process(300, shared=False)
    os.unlink(proc.path("sysvipc", "shm"))
    [shm] = node.collect()
    assert (shm.namespace, shm.readable, shm.segments, shm.shmmax_bytes) == (
        "ipc:[1]",
        False,
        [],
        None,
    )
    assert "No such file or directory" in str(shm.error)
    proc.write("sysvipc/shm", "garbage header\n1 2 3\n")
    [shm] = node.collect()
    assert not shm.readable and str(shm.error).startswith(
        "sysvipc/shm: unexpected header"
    )


def test_node_mode_skips_a_namespace_whose_processes_all_exited(proc: FakeProc) -> None:
    node = Node(proc)
    node.process(100, shared=False)
    proc.add(200)
    os.makedirs(proc.path(200, "ns"))
    os.symlink(
        "ipc:[0]", proc.path(200, "ns", "ipc")
    )  # nowhere to join it from (and read first)
    proc.add(201)  # no ns link: gone, or not ours
    assert [shm.namespace for shm in node.collect()] == ["ipc:[1]"]


class CountingTable(ProcessTable):
    """The process table, counting how often it parses mountinfo for hidepid."""

    hidepid_reads = 0

    def hidepid(self) -> str:
        self.hidepid_reads += 1
        return super().hidepid()


@pytest.fixture
def ipc_namespaces() -> Iterator[List[str]]:
    """Three processes, each in an IPC namespace of its own: their namespaces."""
    sleepers = [subprocess.Popen(["unshare", "--ipc", "sleep", "60"]) for _ in range(3)]
    try:
        ours = os.readlink("/proc/self/ns/ipc")
        namespaces = []
        for sleeper in sleepers:
            deadline = time.monotonic() + 10
            while (
                os.readlink(f"/proc/{sleeper.pid}/ns/ipc") == ours
                and time.monotonic() < deadline
            ):
                time.sleep(0.01)  # unshare has not moved yet
            namespaces.append(os.readlink(f"/proc/{sleeper.pid}/ns/ipc"))
        assert ours not in namespaces
        yield namespaces
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


@needs_root
def test_node_mode_reads_how_proc_hides_pids_once_a_run_not_once_per_namespace(
    ipc_namespaces: List[str],
) -> None:
    # The bug: read() asked the process table for hidepid, which parses all of mountinfo (a
    # node's runs to 2,000 lines), in every IPC namespace it joined: 200 pods, 200 parses.
    table = CountingTable(Paths())
    found = SysvCollector(Paths(), node_mode=True, table=table).collect()
    read = {shm.namespace for shm in found if shm.readable}
    assert set(ipc_namespaces) <= read
    # One, for the process walk (ProcessTable.walk): SysV proves a pid gone by kill(pid, 0)
    # alone, whatever /proc hides.
    assert table.hidepid_reads == 1, table.hidepid_reads


def test_sysvipc():
    segments = parse_sysvipc_shm(fixture("proc", "sysvipc", "shm"))
    assert [(s.shmid, s.size_bytes, s.nattch) for s in segments] == [(3, 8 << 20, 2), (4, 16 << 20, 0)]
    assert segments[0].rss_bytes == 8 << 20
    assert parse_sysvipc_shm("") == []


SYSV_COLUMNS = ["key", "shmid", "perms", "size", "cpid", "lpid", "nattch", "uid", "gid", "cuid", "cgid", "atime",
                "dtime", "ctime", "rss", "swap"]
sysv_rows = st.lists(st.fixed_dictionaries({c: st.integers(0 if c != "key" else -(1 << 31), 1 << 40)
                                            for c in SYSV_COLUMNS}), max_size=6)


@given(st.permutations(SYSV_COLUMNS), sysv_rows, st.booleans())
def test_sysvipc_round_trip_in_any_column_order(columns, rows, with_rss):
    columns = [c for c in columns if with_rss or c not in ("rss", "cpid")]
    text = " ".join(f"{c:>10}" for c in columns) + "\n" + "".join(
        " ".join(f"{row[c]:>10}" for c in columns) + "\n" for row in rows)
    got = [(s.key, s.shmid, s.size_bytes, s.nattch, s.cpid, s.lpid, s.rss_bytes) for s in parse_sysvipc_shm(text)]
    assert got == [(r["key"], r["shmid"], r["size"], r["nattch"], r["cpid"] if with_rss else 0, r["lpid"],
                    r["rss"] if with_rss else 0) for r in rows]


@given(any_text)
def test_sysvipc_any_text_raises_only_value_error(text):
    try:
        parse_sysvipc_shm(text)
    except ValueError as err:
        assert "unexpected header" in str(err)
