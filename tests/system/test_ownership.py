"""Ownership we can prove: a segment is `orphan` only when every process that could hold it
was inspected. Run as the image's user (65534, no capabilities) beside root processes, in
the host's namespaces; the container tier runs the same shapes in real containers."""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from tests.conftest import EVERY_FAMILY, REPO, Exporter, Peer, fallocate, mounted_tmpfs, needs_root, select, value
from tests.helpers import Runs

MiB = 1 << 20


def leak_and_live(shm):
    """A leak (nobody holds it) and live root-owned segments beside it, all long-lived: last
    written an hour ago, as old enough to be named (shmwatch_top_segment_bytes)."""
    fallocate(os.path.join(shm, "psm_leaked02"), 2 * MiB)
    os.chmod(os.path.join(shm, "psm_leaked02"), 0o600)
    peers = [Peer(shm, "mapped", "nccl-live0002", str(3 * MiB)), Peer(shm, "fdonly", "torch_1_live", str(MiB))]
    hour_ago = time.time() - 3600
    for name in ("psm_leaked02", "nccl-live0002"):
        os.utime(os.path.join(shm, name), (hour_ago, hour_ago))
    return peers


def states(samples, mount):
    found = {}
    for labels, v in select(samples, "shmwatch_segments", mount=mount):
        found[(labels["class"], labels["state"])] = v
    return found


@needs_root
def test_another_uid_without_ptrace_calls_nothing_leaked(nonroot_python):
    with mounted_tmpfs("32m") as shm:
        peers = leak_and_live(shm)
        try:
            with Exporter(f"--shm.mount={shm}", "--no-collector.gpu", "--no-collector.cgroup", "--no-inotify",
                          EVERY_FAMILY, run_as=nonroot_python,
                          env={"SHMWATCH_SEGMENTS_IGNORE_UNREADABLE": ""}) as exporter:
                s = exporter.scrape()
                log = exporter.log()
            check = subprocess.run([*nonroot_python, "-m", "exporter", "check", f"--shm.mount={shm}", "--output=json",
                                    "--no-collector.gpu", "--no-collector.cgroup"], cwd=REPO, capture_output=True,
                                   text=True, timeout=60, env={**os.environ, "SHMWATCH_SEGMENTS_IGNORE_UNREADABLE": ""})
        finally:
            for peer in peers:
                peer.close()
    # The live nccl segment and the leak are both listed and held by nobody we could read:
    # unverified, never orphan.
    assert states(s, shm) == {("nccl", "unverified"): 1, ("python_shm", "unverified"): 1}
    assert not select(s, "shmwatch_top_segment_bytes", mount=shm, state="orphan")
    assert value(s, "shmwatch_orphan_oldest_age_seconds", mount=shm) == 0
    assert value(s, "shmwatch_mount_owners_verified", mount=shm) == 0
    assert value(s, "shmwatch_proc_unreadable") >= 2  # at least the two root peers
    doc = json.loads(check.stdout)
    [facts] = doc["shm"]
    assert facts["orphans"] == []
    assert {u["name"] for u in facts["unverified"]} == {"nccl-live0002", "psm_leaked02"}
    assert not [f for f in doc["findings"] if "rm " in f["remedy"]], doc["findings"]
    assert [f for f in doc["findings"] if "may be live" in f["message"] and "CAP_SYS_PTRACE" in f["remedy"]]
    # Both say which processes they could not read (root's: the peers among them).
    said = next(f["message"] for f in doc["findings"] if "may be live" in f["message"])
    assert re.search(r"could not read (\d+) process\(es\): \S+ \(pid \d+, uid 0\)", said), said
    assert int(re.search(r"could not read (\d+) process", said).group(1)) >= 2  # the two root peers at least
    assert re.search(r"'unverified', not 'orphan': could not read \S+ \(pid \d+, uid 0\)", log), log


@needs_root
def test_hidepid_hidden_processes_are_counted(nonroot_python):
    """hidepid=2 on the exporter's /proc: root's processes are not even listed; they are
    counted (pidfd_open needs no permission) and the leak stays unverified."""
    with mounted_tmpfs("32m") as shm:
        peers = leak_and_live(shm)
        proc = tempfile.mkdtemp(prefix="shmwatch-proc-")  # reachable by 65534, unlike tmp_path
        os.chmod(proc, 0o755)
        subprocess.run(["mount", "-t", "proc", "-o", "hidepid=2", "proc", proc], check=True)
        try:
            with Exporter(f"--shm.mount={shm}", f"--path.procfs={proc}", "--no-collector.gpu", "--no-collector.cgroup",
                          "--no-inotify", EVERY_FAMILY, run_as=nonroot_python,
                          env={"SHMWATCH_SEGMENTS_IGNORE_UNREADABLE": ""}) as exporter:
                s = exporter.scrape()
        finally:
            subprocess.run(["umount", "-l", proc], check=False)
            os.rmdir(proc)
            for peer in peers:
                peer.close()
    hidden_root_processes = sum(1 for p in os.listdir("/proc") if p.isdigit() and os.stat(f"/proc/{p}").st_uid == 0)
    assert value(s, "shmwatch_proc_unreadable") >= min(hidden_root_processes, 10)
    assert states(s, shm) == {("nccl", "unverified"): 1, ("python_shm", "unverified"): 1}
    assert value(s, "shmwatch_mount_owners_verified", mount=shm) == 0


@needs_root
def test_root_sees_every_owner_and_the_real_leak(tmpfs):
    """The same state read by root: the live segments are attributed, the leak is an orphan."""
    peers = leak_and_live(tmpfs)
    try:
        with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", "--no-collector.cgroup",
                      EVERY_FAMILY) as exporter:
            s = exporter.scrape()
        comm = peers[0].comm
    finally:
        for peer in peers:
            peer.close()
    assert states(s, tmpfs) == {("nccl", "linked"): 1, ("python_shm", "orphan"): 1, ("torch", "hidden"): 1}
    assert value(s, "shmwatch_mount_owners_verified", mount=tmpfs) == 1
    [(labels, _)] = select(s, "shmwatch_top_segment_bytes", mount=tmpfs, state="linked")
    assert labels["owner"] == comm  # its holder by name, not by pid


@needs_root
def test_hidden_processes_are_unknown_where_pidfd_open_is_refused(monkeypatch):
    """Before Linux 5.3 pidfd_open() is ENOSYS, and a seccomp profile may refuse it (EPERM):
    no probe answered is not 'none hidden' (which lets a leak be called one)."""
    import errno

    from exporter.host.paths import Paths
    from exporter.host.proctable import ProcessTable

    table = ProcessTable(Paths())
    listed = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    assert table.count_invisible(listed) is not None  # root lists them all (or those forked since)
    for code in (errno.ENOSYS, errno.EPERM):
        def refused(pid, flags=0, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "pidfd_open", refused)
        assert table.count_invisible(listed) is None, code


def test_a_procfs_that_cannot_be_listed_proves_nothing(tmp_path):
    """No process seen is not 'no process holds it': the leak stays unverified, and the
    count of uninspected processes is unknown, so it is absent rather than 0."""
    from exporter.collectors.segments import SegmentsCollector
    from exporter.host.paths import Paths

    shm = tmp_path / "shm"
    shm.mkdir()
    fallocate(str(shm / "psm_maybe"), 4096)
    inv = Runs(SegmentsCollector(Paths(procfs=str(tmp_path / "no-proc"))), [str(shm)]).full()
    assert [(s.name, s.state) for s in inv.mounts[0].rows()] == [("psm_maybe", "unverified")]
    assert inv.proc_unreadable is None and not inv.owners_complete


@needs_root
def test_rm_is_advised_only_for_orphans_of_single_owner_classes(tmpfs):
    """podman's lock file (class other) is nobody's to delete; a leaked NCCL segment is."""
    fallocate(os.path.join(tmpfs, "libpod_lock"), 4096)
    fallocate(os.path.join(tmpfs, "nccl-Gone01"), MiB)
    fallocate(os.path.join(tmpfs, "sem.mp-lock"), 4096)
    done = subprocess.run([sys.executable, "-m", "exporter", "check", f"--shm.mount={tmpfs}", "--output=json",
                           "--no-collector.gpu", "--no-collector.cgroup"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    doc = json.loads(done.stdout)
    advice = [f for f in doc["findings"] if "rm " in f["remedy"]]
    assert len(advice) == 1 and "nccl-Gone01" in advice[0]["remedy"], doc["findings"]
    assert "libpod_lock" not in advice[0]["remedy"] and "sem.mp-lock" not in advice[0]["remedy"]
    [foreign] = [f for f in doc["findings"] if "libpod_lock" in f["message"]]
    assert foreign["severity"] == "info" and "rm" not in foreign["remedy"]


@needs_root
def test_a_pid_namespace_of_its_own_proves_nothing(tmpfs):
    """A sidecar given the server's IPC namespace but not its PID namespace (no --pid, no
    shareProcessNamespace) sees only itself: a live segment must not look leaked."""
    with Peer(tmpfs, "mapped", "nccl-elsewhere", str(MiB)):
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "exporter",
                               "check", f"--shm.mount={tmpfs}", "--output=json", "--no-collector.gpu",
                               "--no-collector.cgroup"], cwd=REPO, capture_output=True, text=True, timeout=60)
    doc = json.loads(done.stdout)
    [facts] = doc["shm"]
    assert facts["orphans"] == [] and [u["name"] for u in facts["unverified"]] == ["nccl-elsewhere"], facts
    assert not [f for f in doc["findings"] if "rm " in f["remedy"]], doc["findings"]
    [why] = [f["message"] for f in doc["findings"] if "held by no process shmwatch could inspect" in f["message"]]
    assert "the workload's processes: none visible (a PID namespace of its own)" in why, why


def _procfs_of_parents_only(root, pid_namespace: str) -> str:
    """A /proc that lists only init and shmwatch (its child): what a CI machine shows a
    test run whose output goes to a file. Its ns/pid link names the PID namespace; both are
    in one mount namespace (one container)."""
    procfs = os.path.join(root, "proc")
    for pid, comm, ppid in ((1, "init", 0), (300, "shmwatch", 1)):
        os.makedirs(os.path.join(procfs, str(pid), "ns"))
        with open(os.path.join(procfs, str(pid), "stat"), "w") as f:
            f.write(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194304" + " 0" * 13 + " 100 0\n")
        os.symlink(pid_namespace, os.path.join(procfs, str(pid), "ns", "pid"))
        os.symlink("mnt:[4026532201]", os.path.join(procfs, str(pid), "ns", "mnt"))
    os.symlink("300", os.path.join(procfs, "self"))
    return procfs


def test_the_initial_pid_namespace_hides_no_workload(tmp_path):
    """A machine whose only processes are shmwatch's parents (a CI runner writing to a file,
    not to a pipe) hides nothing when it is the initial PID namespace: the kernel's fixed
    inode for it says so. A PID namespace made later, with the same processes, is a sidecar
    that sees none of the workload. Both must hold; the first failed CI twice."""
    from exporter.host.paths import Paths
    from exporter.host.proctable import ProcessTable
    initial = ProcessTable(Paths(procfs=_procfs_of_parents_only(tmp_path / "a", "pid:[4026531836]"))).walk()
    assert sorted(p.comm for p in initial.processes) == ["init", "shmwatch"] and initial.workload_visible
    later = ProcessTable(Paths(procfs=_procfs_of_parents_only(tmp_path / "b", "pid:[4026532198]"))).walk()
    assert sorted(p.comm for p in later.processes) == ["init", "shmwatch"] and not later.workload_visible
