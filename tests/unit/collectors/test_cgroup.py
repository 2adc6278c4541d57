# mypy: allow-untyped-calls
"""Which memory cgroup a sidecar or host shmwatch reads, and the limit it reports: the
--cgroup.path, the target process's, the workload's (its pod's where the pod's limit binds),
our own on a host, or an estimate from the workload's processes when no cgroup can be read;
never shmwatch's own cgroup under the workload's name. Fixture trees (/proc and cgroupfs):
part of the mutation selection."""

import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest

from exporter.collectors.cgroup import ESTIMATE_CGROUP, CgroupAt, CgroupCollector, IncompleteView
from exporter.collectors.source import RunInput
from exporter.host.cgroupfs import BindingLimit, effective_limit
from exporter.host.paths import Paths
from exporter.host.proctable import PF_KTHREAD
from exporter.model.types import CgroupMemory
from tests.helpers import UID, FakeProc, cgroup_tree

GiB, MiB = 1 << 30, 1 << 20
POD = "pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
POD_UID = POD[3:]


class Host:
    """A /proc tree and a cgroupfs under one directory."""

    def __init__(self, tmp_path: Path) -> None:
        self.proc = FakeProc(str(tmp_path / "proc"))
        self.sys = tmp_path / "sys"
        self.cgroupfs = self.sys / "fs" / "cgroup"
        self.cgroupfs.mkdir(parents=True)
        self.paths = Paths(procfs=self.proc.root, sysfs=str(self.sys))

    def cgroup(
        self,
        relative: str,
        usage: int,
        limit: Optional[int] = None,
        version: int = 2,
        files: Optional[Dict[str, str]] = None,
    ) -> str:
        """A cgroup directory: usage, limit, memory.stat (a quarter inactive, half shmem), `files`."""
        directory = self.cgroupfs / relative.lstrip("/")
        directory.mkdir(parents=True, exist_ok=True)
        written: Dict[str, str] = {
            "memory.stat": f"inactive_file {usage // 4}\nshmem {usage // 2}\n"
        }
        if version == 2:
            written["memory.current"] = f"{usage}\n"
            written["memory.max"] = "max\n" if limit is None else f"{limit}\n"
        else:
            written["memory.usage_in_bytes"] = f"{usage}\n"
            written["memory.limit_in_bytes"] = f"{limit or 9223372036854771712}\n"
        written.update(files or {})
        for name, text in written.items():
            (directory / name).write_text(text)
        return str(directory)

    def on_the_host(self) -> None:
        self.proc.add(2, "kthreadd", flags=PF_KTHREAD, ppid=0)

    def ours(self, cgroup_text: str) -> None:
        self.proc.write("self/cgroup", cgroup_text)

    def process(self, pid: int, comm: str, cgroup_text: str, cmdline: str = "") -> None:
        self.proc.add(pid, comm, cgroup=cgroup_text)
        with open(self.proc.path(pid, "cmdline"), "wb") as f:
            f.write((cmdline or comm).replace(" ", "\0").encode() + b"\0")

    def collect(self, mounts: Sequence[str] = (), **options: Any) -> List[CgroupMemory]:
        """One run, handed the watched shm `mounts` as the scheduler would."""
        return CgroupCollector(self.paths, **options).collect(
            RunInput(mounts=tuple(mounts))
        )


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def test_a_cgroup_path_names_the_cgroup_v2(host: Host) -> None:
    host.cgroup("/kubepods", 10 * GiB, None)
    host.cgroup("/kubepods/" + POD, 3 * GiB, 4 * GiB)
    host.cgroup(f"/kubepods/{POD}/ctr", 2 * GiB, None)
    [got] = host.collect(cgroup_path=f"/kubepods/{POD}/ctr")
    assert (
        got.cgroup,
        got.version,
        got.usage_bytes,
        got.limit_bytes,
        got.limit_source,
    ) == (
        f"/kubepods/{POD}/ctr",
        2,
        2 * GiB,
        4 * GiB,
        "pod",
    )
    assert (got.working_set_bytes, got.shmem_bytes, got.pod_uid, got.estimated) == (
        1536 * MiB,
        GiB,
        "",
        False,
    )


def test_a_cgroup_path_names_the_cgroup_v1_first(host: Host) -> None:
    host.cgroup("/memory/a", 100, 1000, version=1)
    host.cgroup("/a", 200, 2000)
    [got] = host.collect(cgroup_path="/a")
    assert (
        got.cgroup,
        got.version,
        got.usage_bytes,
        got.limit_bytes,
        got.limit_source,
    ) == ("/a", 1, 100, 1000, "self")


def test_a_cgroup_path_may_be_its_directory(host: Host) -> None:
    v2 = host.cgroup("/unified/x", 300, 3000)
    [got] = host.collect(cgroup_path=v2)
    assert (got.cgroup, got.version, got.usage_bytes) == ("/unified/x", 2, 300)
    v1 = host.cgroup("/memory/y", 400, 4000, version=1)
    [got] = host.collect(cgroup_path=v1)
    assert (got.cgroup, got.version, got.usage_bytes) == ("/y", 1, 400)
    v1_root = host.cgroup("/memory", 500, version=1)
    assert host.collect(cgroup_path=v1_root)[0].cgroup == "/"


def test_no_such_cgroup_says_where_it_looked(host: Host) -> None:
    with pytest.raises(FileNotFoundError) as raised:
        host.collect(cgroup_path="/nope")
    fs = str(host.cgroupfs)
    assert (
        str(raised.value)
        == f"no memory cgroup found (tried {fs}/memory/nope, {fs}/nope, {fs}/unified/nope)"
    )


def test_the_flag_limit_binds_where_it_is_tighter(host: Host) -> None:
    host.cgroup("/a", 100, 2000)
    assert host.collect(cgroup_path="/a", limit_override=1999)[0].limit_bytes == 1999
    assert host.collect(cgroup_path="/a", limit_override=1999)[0].limit_source == "flag"
    got = host.collect(cgroup_path="/a", limit_override=2000)[0]
    assert (got.limit_bytes, got.limit_source) == (2000, "self")
    host.cgroup("/b", 100, None)
    got = host.collect(cgroup_path="/b", limit_override=5000)[0]
    assert (got.limit_bytes, got.limit_source) == (5000, "flag")


def test_on_the_host_our_own_cgroup(host: Host) -> None:
    host.on_the_host()
    host.ours("0::/system.slice/shmwatch.service\n")
    host.cgroup("/system.slice/shmwatch.service", 50 * MiB, GiB)
    host.process(
        10, "vllm", "0::/kubepods/x\n"
    )  # on the host, processes are nobody's workload
    [got] = host.collect()
    assert (got.cgroup, got.limit_bytes, got.estimated) == (
        "/system.slice/shmwatch.service",
        GiB,
        False,
    )


def sidecar(host: Host, own_limit: Optional[int] = None) -> None:
    """The server (pid 10) and shmwatch in one pod, each its container's cgroup."""
    host.ours(f"0::/kubepods/{POD}/sidecar\n")
    host.cgroup("/kubepods", 100 * GiB)
    host.cgroup(f"/kubepods/{POD}", 3 * GiB, 16 * GiB)
    host.cgroup(f"/kubepods/{POD}/server", 2 * GiB, own_limit)
    host.process(1, "pause", f"0::/kubepods/{POD}\n")
    host.process(
        7,
        "python3",
        f"0::/kubepods/{POD}/sidecar\n",
        "python3 -m exporter --mode=sidecar",
    )
    host.process(
        8, "bash", f"0::/kubepods/{POD}/sidecar\n"
    )  # a shell exec'd into the sidecar
    host.process(
        10,
        "python3",
        f"0::/kubepods/{POD}/server\n",
        "python3 -m vllm.entrypoints.openai.api_server",
    )


def test_a_sidecar_reads_the_workloads_pod_where_the_pods_limit_binds(
    host: Host,
) -> None:
    sidecar(host)
    [got] = host.collect()
    assert (got.cgroup, got.usage_bytes, got.limit_bytes, got.limit_source) == (
        f"/kubepods/{POD}",
        3 * GiB,
        16 * GiB,
        "pod",
    )


def test_a_sidecar_reads_the_workloads_container_where_its_own_limit_binds(
    host: Host,
) -> None:
    sidecar(host, own_limit=8 * GiB)
    [got] = host.collect()
    assert (got.cgroup, got.limit_bytes, got.limit_source) == (
        f"/kubepods/{POD}/server",
        8 * GiB,
        "self",
    )


def test_a_pod_cgroup_that_cannot_be_read_leaves_the_containers(host: Host) -> None:
    sidecar(host)
    os.unlink(host.cgroupfs / "kubepods" / POD / "memory.stat")
    [got] = host.collect()
    assert (got.cgroup, got.limit_source) == (f"/kubepods/{POD}/server", "pod")


def test_shmwatch_is_not_taken_for_the_workload_whatever_its_comm(host: Host) -> None:
    """Below the server's pid and in another cgroup than ours, each of these would be taken."""
    sidecar(host)
    host.cgroup("/elsewhere", GiB, GiB)
    host.process(2, "python3", "0::/elsewhere\n", "python3 -m exporter --mode=sidecar")
    host.process(3, "python3", "0::/elsewhere\n", "/usr/local/bin/shmwatch check")
    host.process(5, "python3", "0::/elsewhere\n", "python3 /usr/bin/shmwatch")
    assert host.collect()[0].cgroup == f"/kubepods/{POD}"
    host.process(
        4, "python3", "0::/elsewhere\n", "python3 -m exporterx"
    )  # another module
    assert host.collect()[0].cgroup == "/elsewhere"


def test_a_workload_whose_cmdline_cannot_be_read_is_still_the_workload(
    host: Host,
) -> None:
    sidecar(host)
    os.unlink(host.proc.path(10, "cmdline"))
    assert host.collect()[0].cgroup == f"/kubepods/{POD}"


def test_the_target_process_is_never_shmwatch_itself(host: Host) -> None:
    """--cgroup.target-process=engine: shmwatch's own command line names it too."""
    sidecar(host)
    me = os.getpid()
    host.cgroup("/kubepods/other", GiB, 2 * GiB)
    host.process(
        me,
        "python3",
        f"0::/kubepods/{POD}/sidecar\n",
        "python3 -m exporter --cgroup.target-process=engine",
    )
    host.process(me + 1, "python3", "0::/kubepods/other\n", "engine --serve")
    assert host.collect(target_process="engine")[0].cgroup == "/kubepods/other"


def test_the_target_process_names_the_cgroup(host: Host) -> None:
    sidecar(host)
    host.cgroup("/kubepods/other", GiB, 2 * GiB)
    host.process(20, "ray", "0::/kubepods/other\n", "ray start --head")
    assert host.collect(target_process="^ray")[0].cgroup == "/kubepods/other"
    with pytest.raises(
        LookupError,
        match=re.escape("no process matches --cgroup.target-process 'triton'"),
    ):
        host.collect(target_process="triton")


def test_alone_in_a_pid_namespace_our_cgroup_is_not_passed_off_as_the_workloads(
    host: Host,
) -> None:
    host.ours("0::/docker/abc\n")
    host.cgroup("/docker/abc", MiB, GiB)
    host.process(7, "python3", "0::/docker/abc\n", "python3 -m exporter")
    with pytest.raises(LookupError) as raised:
        host.collect()
    assert str(raised.value) == (
        "no workload shares this PID namespace (docker --pid=container:<server>, Kubernetes "
        "shareProcessNamespace), and shmwatch's own cgroup is not the workload's: share it, "
        "or name the cgroup with --cgroup.path"
    )


def test_without_its_cgroup_the_workloads_memory_is_estimated(host: Host) -> None:
    host.ours("0::/../sidecar\n")
    host.process(10, "python3", "0::/../server\n", "python3 -m sglang.launch_server")
    host.process(11, "python3", "0::/../server\n")
    host.proc.write("10/smaps_rollup", "Pss_Anon: 1024 kB\nPss_File: 512 kB\n")
    host.proc.write("11/smaps_rollup", "Pss_Anon: 2048 kB\n")
    [got] = host.collect(mounts=["/nonexistent/shm"])
    assert (got.cgroup, got.version, got.estimated, got.limit_source) == (
        ESTIMATE_CGROUP,
        0,
        True,
        "none",
    )
    assert (
        got.usage_bytes,
        got.working_set_bytes,
        got.shmem_bytes,
        got.limit_bytes,
    ) == (3584 * 1024, 3584 * 1024, 0, None)
    [got] = host.collect(limit_override=GiB)
    assert (got.limit_bytes, got.limit_source) == (GiB, "flag")


def test_the_estimate_counts_each_shm_filesystem_once(
    host: Host, tmp_path: Path
) -> None:
    """Two watched paths on one filesystem (one tmpfs watched twice): its used bytes once; on
    the shared disk beneath the test, to within what others write meanwhile."""
    host.ours("0::/../sidecar\n")
    host.process(10, "python3", "0::/../server\n", "python3 -m vllm")
    host.proc.write("10/smaps_rollup", "Pss_Anon: 1024 kB\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    [got] = host.collect(mounts=[str(tmp_path / "a"), str(tmp_path / "b")])
    st = os.statvfs(tmp_path)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    shm = got.shmem_bytes
    assert shm is not None and abs(shm - used) < 64 << 20
    assert got.working_set_bytes == got.usage_bytes == 1024 * 1024 + shm


def test_a_cgroup_in_another_cgroup_namespace_is_refused_without_the_hosts_cgroupfs(
    host: Host,
) -> None:
    with pytest.raises(LookupError) as raised:
        host.collect(cgroup_path="/../abc")
    assert str(raised.value).startswith(
        "cgroup /../abc is outside this container's cgroup namespace"
    )


def test_a_mounted_cgroupfs_shows_a_cgroup_outside_ours(
    host: Host, tmp_path: Path
) -> None:
    shown = tmp_path / "hostcg" / "server"
    shown.mkdir(parents=True)
    (shown / "memory.current").write_text("4096\n")
    (shown / "memory.stat").write_text("shmem 0\n")
    host.proc.self_mountinfo(
        [f"40 1 0:30 /.. {tmp_path}/hostcg rw - cgroup2 cgroup2 rw\n"]
    )
    [got] = host.collect(cgroup_path="/../server")
    assert (got.cgroup, got.version, got.usage_bytes) == ("/../server", 2, 4096)


def test_processes_we_cannot_read_may_be_the_workload(host: Host) -> None:
    sidecar(host)
    host.proc.add(12)
    os.unlink(host.proc.path(12, "stat"))
    os.mkdir(host.proc.path(12, "stat"))
    with pytest.raises(IncompleteView) as raised:
        host.collect()
    assert str(raised.value) == (
        "1 process(es) in this PID namespace could not be read: the workload's memory cannot be "
        "estimated (give shmwatch the server's UID or CAP_SYS_PTRACE, or the host's cgroupfs)"
    )


def test_processes_hidepid_hides_may_be_the_workload(host: Host) -> None:
    sidecar(host)
    host.proc.self_mountinfo(hidepid="2")
    host.proc.counters(last_pid=1, pid_max=1, forks=5)
    shutil.rmtree(host.proc.path(1))  # pid 1 hidden: probed, found
    with pytest.raises(
        IncompleteView,
        match="^0 process.* could not be read and some are hidden by hidepid",
    ):
        host.collect()


def test_a_workload_process_whose_cgroup_is_denied_stops_the_estimate(
    host: Host,
) -> None:
    sidecar(host)
    host.proc.deny(10, "cgroup")
    with pytest.raises(IncompleteView) as raised:
        host.collect()
    assert str(raised.value) == (
        "the cgroup of process 10 could not be read (Permission denied): the workload's memory "
        "cannot be estimated"
    )


def test_a_workload_process_gone_meanwhile_is_skipped(host: Host) -> None:
    sidecar(host)
    host.process(9, "python3", f"0::/kubepods/{POD}/server\n")
    os.unlink(host.proc.path(9, "cgroup"))
    assert host.collect()[0].cgroup == f"/kubepods/{POD}"


def test_without_our_own_cgroup_no_process_is_the_workload(host: Host) -> None:
    host.process(10, "vllm", "0::/kubepods/x\n")
    with pytest.raises(LookupError, match="^no workload shares"):
        host.collect()


def test_a_path_climbing_out_of_the_cgroupfs_is_never_read_through_it(
    host: Host,
) -> None:
    escape = host.sys / "fs" / "escape"
    escape.mkdir()
    (escape / "memory.current").write_text("1\n")
    (escape / "memory.stat").write_text("shmem 0\n")
    host.cgroup("/memory", 1, version=1)
    with pytest.raises(
        LookupError, match="is outside this container's cgroup namespace"
    ):
        host.collect(cgroup_path="/../escape")


def test_on_a_hybrid_host_v1_reads_the_memory_controllers_path(host: Host) -> None:
    host.on_the_host()
    host.ours("4:memory:/v1/ours\n0::/v2/ours\n")
    host.cgroup("/memory/v1/ours", 100, 1000, version=1)
    host.cgroup("/unified/v2/ours", 200, 2000)
    assert (host.collect()[0].cgroup, host.collect()[0].version) == ("/v1/ours", 1)


def test_a_hierarchy_without_the_memory_files_is_passed_over(host: Host) -> None:
    (host.cgroupfs / "memory" / "a").mkdir(
        parents=True
    )  # v1 mounted, no memory controller there
    host.cgroup("/a", 200, 2000)
    assert (
        host.collect(cgroup_path="/a")[0].version,
        host.collect(cgroup_path="/a")[0].usage_bytes,
    ) == (2, 200)


def test_no_cgroup_named_at_all_says_nothing_was_tried(host: Host) -> None:
    host.on_the_host()
    host.ours("")
    with pytest.raises(FileNotFoundError) as raised:
        host.collect()
    assert str(raised.value) == "no memory cgroup found (tried nothing)"


def test_a_v2_cgroup_shown_by_a_mounted_cgroupfs(host: Host, tmp_path: Path) -> None:
    for name, usage in (("first", None), ("second", 4096)):
        shown = tmp_path / name / "server"
        shown.mkdir(parents=True)
        if usage:
            (shown / "memory.current").write_text(f"{usage}\n")
            (shown / "memory.stat").write_text("shmem 0\n")
    host.on_the_host()
    host.ours("0::/../server\n")
    host.proc.self_mountinfo(
        [
            f"40 1 0:30 /.. {tmp_path}/first rw - cgroup2 cgroup2 rw\n",  # shows it, no memory files
            f"41 1 0:31 /.. {tmp_path}/second rw - cgroup2 cgroup2 rw\n",
        ]
    )
    [got] = host.collect()
    assert (got.cgroup, got.version, got.usage_bytes) == ("/../server", 2, 4096)


def test_a_v1_cgroup_shown_by_a_mounted_memory_hierarchy(
    host: Host, tmp_path: Path
) -> None:
    shown = tmp_path / "v1" / "server"
    shown.mkdir(parents=True)
    (shown / "memory.usage_in_bytes").write_text("8192\n")
    (shown / "memory.stat").write_text("total_shmem 0\n")
    host.on_the_host()
    host.ours("4:memory:/../server\n")
    host.proc.self_mountinfo(
        [f"40 1 0:30 /.. {tmp_path}/v1 rw - cgroup cgroup rw,memory\n"]
    )
    [got] = host.collect()
    assert (got.cgroup, got.version, got.usage_bytes) == ("/../server", 1, 8192)


def test_a_sidecars_v1_cgroup_counts_no_childrens_kills(host: Host) -> None:
    host.cgroup(
        "/memory/a", 100, 1000, version=1, files={"memory.oom_control": "oom_kill 1\n"}
    )
    host.cgroup(
        "/memory/a/child", 50, version=1, files={"memory.oom_control": "oom_kill 3\n"}
    )
    [got] = host.collect(cgroup_path="/a")
    assert (got.oom_kills, got.child_oom_kills) == (1, ())


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


def test_v1_parent_limit_binds(tmp_path):
    """A v1 container with no limit of its own inside a pod with one: memory.stat's
    hierarchical_memory_limit is the limit that OOM-kills it."""
    leaf = tmp_path / "sys" / "fs" / "cgroup" / "memory" / "kubepods" / "pod1" / "c"
    leaf.mkdir(parents=True)
    (leaf / "memory.usage_in_bytes").write_text(f"{100 * MiB}\n")
    (leaf / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited here
    (leaf / "memory.stat").write_text(f"total_inactive_file {10 * MiB}\nhierarchical_memory_limit {512 * MiB}\n")
    paths = Paths(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys"))
    [result] = CgroupCollector(paths, cgroup_path="/kubepods/pod1/c").collect()
    assert (result.version, result.limit_bytes, result.limit_source) == (1, 512 * MiB, "ancestor")
    assert result.working_set_bytes == 90 * MiB


def test_node_cgroups_are_not_stretched_whole():
    """Each pod's cgroup stretches on its own (cgroup.py): stretching the whole source as well
    would compound the two delays, and one pod's change would end every pod's stretch."""
    from exporter.collectors.cgroup import CgroupCollector
    from exporter.host.paths import Paths

    source = CgroupCollector(Paths("/proc", "/nonexistent", "/"), node_mode=True)
    assert not source.stretches(RunInput(kill_log_complete=True))
