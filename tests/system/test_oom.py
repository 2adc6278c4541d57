"""OOM kills from the kernel log: the parser on text fixtures, the per-pod count in the model,
and a real kill in a real v1 pod/container cgroup pair counted for the pod after the
container's cgroup is gone."""
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, List, Tuple


from exporter.model.types import CgroupMemory, OomKill, OomReports
from exporter.collectors.source import Source
from exporter.collectors.cgroup import CgroupCollector
from exporter.collectors.oom import KmsgRecord, parse_kmsg_record, parse_oom_kills
from exporter.host.paths import Paths
from tests.conftest import REPO, Exporter, needs_root, prerequisite_missing, remove_cgroup, select, value
from tests.helpers import registry_for, run_every_source_once

if TYPE_CHECKING:
    from exporter.model.step import ModelStep

FIXTURE = os.path.join(REPO, "tests", "fixtures", "kmsg", "oom.txt")
POD = "3c1f5a2e-8b7d-4e6f-9a01-23456789abcd"
MiB = 1 << 20
V1_ROOT = "/sys/fs/cgroup/memory"



def kmsg_records(text: str) -> List[str]:
    """Text as `cat /dev/kmsg` prints it -> records (a line starting with a space continues one)."""
    records = []
    for line in text.splitlines():
        if line.startswith(" ") and records:
            records[-1] += "\n" + line
        elif line.strip():
            records.append(line)
    return records


def fixture_kills() -> List[OomKill]:
    with open(FIXTURE) as f:
        return parse_oom_kills(kmsg_records(f.read()))


def test_parses_every_report_shape():
    kills = fixture_kills()
    assert [(k.pid, k.comm) for k in kills] == [(9008, "python3"), (4242, "vllm (engine)"), (777, "java"),
                                               (31337, "hog")]
    cgroupfs, systemd, legacy, system = kills
    # cgroupfs driver, >= 4.19: the memcgs from the oom-kill line, the RSS from the last line.
    assert cgroupfs.task_memcg == f"/kubepods/burstable/pod{POD}/4f2a9c0e1b"
    assert cgroupfs.pod_uid == POD and cgroupfs.pod_cgroup == f"/kubepods/burstable/pod{POD}"
    assert (cgroupfs.anon_rss_bytes, cgroupfs.file_rss_bytes, cgroupfs.shmem_rss_bytes) == \
        (8976 * 1024, 6636 * 1024, 0)
    assert cgroupfs.constraint == "CONSTRAINT_MEMCG" and cgroupfs.seq == 3900
    # systemd driver: the pod's UID with underscores, the pod cgroup is a .slice; a comm
    # with spaces and parentheses; the pod's own limit was hit (oom_memcg is the pod).
    assert systemd.pod_uid == POD and systemd.shmem_rss_bytes == 512 * MiB
    assert systemd.pod_cgroup.endswith(f"kubepods-burstable-pod{POD.replace('-', '_')}.slice")
    assert systemd.oom_memcg == systemd.pod_cgroup
    # Before 4.19: "Task in ... killed as a result of limit of ...", then "Killed process".
    assert legacy.task_memcg.endswith("/aa11") and legacy.pod_uid == "0a0b0c0d-1111-2222-3333-444455556666"
    assert legacy.anon_rss_bytes == 64 * MiB
    # A system-wide OOM: no oom_memcg, and no pod.
    assert system.oom_memcg == "" and system.constraint == "CONSTRAINT_NONE" and system.pod_uid == ""


def test_kmsg_records_and_what_is_not_one():
    assert parse_kmsg_record("6,12,345,-;hello\n SUBSYSTEM=net") == KmsgRecord(seq=12, usec=345, message="hello")
    assert parse_kmsg_record("6,12,345,c,more;x") == KmsgRecord(seq=12, usec=345, message="x")
    assert parse_kmsg_record("no record") is None and parse_kmsg_record("a,b,c;x") is None
    # The oom_reaper's line names a process too: it is not a second kill.
    assert len(parse_oom_kills(["6,1,1,-;oom_reaper: reaped process 5 (x), now anon-rss:0kB"])) == 0
    # A "Killed process" line whose oom-kill line was lost still counts, without cgroups.
    lone = parse_oom_kills(["3,2,2,-;Memory cgroup out of memory: Killed process 5 (x) total-vm:1kB, "
                            "anon-rss:4kB, file-rss:0kB, shmem-rss:8kB"])
    assert [(k.pid, k.task_memcg, k.shmem_rss_bytes) for k in lone] == [(5, "", 8192)]


class Replay(Source):
    """The kernel log's kills, replayed: the oom source with the log's text as its input."""
    name = "oom"

    def __init__(self, lost=0):
        self.batches, self.lost = [], lost

    def collect(self, run):
        return OomReports(tuple(self.batches.pop(0)) if self.batches else (), self.lost)


def pod_tree(tmp_path, uid, kills):
    cg = tmp_path / "sys" / "fs" / "cgroup" / "memory" / "kubepods" / "burstable" / f"pod{uid}"
    cg.mkdir(parents=True)
    for name, text in {"memory.usage_in_bytes": "1000\n", "memory.limit_in_bytes": str(1 << 30),
                       "memory.stat": "total_inactive_file 0\n", "memory.oom_control": f"oom_kill {kills}\n"}.items():
        (cg / name).write_text(text)
    return cg


def test_pod_count_is_the_kernel_log_or_its_own_counter_and_never_goes_down(tmp_path):
    """The pod's cgroup says 0 (v1 counts a kill only in the victim's memcg), the kernel log
    says 1: 1. Then the pod's counter says 5 (kills before we started): 5. Then the counter
    file is gone with the pod: still 5, never less."""
    cg = pod_tree(tmp_path, POD, 0)
    paths = Paths(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys"))
    # A log that lost records: every pod's counter is read every poll (a complete log
    # stretches a steady pod's reads: the kills it reports are the ones the counters add).
    replay = Replay(lost=1)
    registry, h = registry_for(CgroupCollector(paths, node_mode=True), replay, mounts=[])
    h.step.node_mode = True  # what --mode=node sets through discovery
    replay.batches = [[k for k in fixture_kills() if k.pod_uid == POD]]

    def count():
        run_every_source_once(h.sampler)
        return registry.get_sample_value("shmwatch_cgroup_oom_kills_total",
                                         {"cgroup": f"/kubepods/burstable/pod{POD}", "pod_uid": POD})
    assert count() == 1
    # The fixture's systemd-driver kill of the same pod UID: a pod cgroup not on this host
    # (gone, or never seen): its kill is still counted, under the cgroup the kernel named.
    systemd = [labels["cgroup"] for labels, v in
               [(dict(s.labels), s.value) for f in registry.collect() for s in f.samples
                if s.name == "shmwatch_cgroup_oom_kills_total"] if v == 1 and labels["cgroup"].endswith(".slice")]
    assert len(systemd) == 1 and "kubepods-burstable-pod" in systemd[0]
    (cg / "memory.oom_control").write_text("oom_kill 5\n")
    assert count() == 5
    for name in os.listdir(cg):
        os.unlink(cg / name)
    cg.rmdir()
    assert count() == 5


def test_no_count_is_invented_without_a_source(tmp_path):
    """No kernel log watched and no counter in the cgroup: no series, not a confident 0."""
    cg = pod_tree(tmp_path, POD, 0)
    (cg / "memory.oom_control").unlink()
    paths = Paths(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys"))
    registry, h = registry_for(CgroupCollector(paths, node_mode=True), mounts=[])
    assert registry.get_sample_value("shmwatch_cgroup_memory_usage_bytes",
                                     {"cgroup": f"/kubepods/burstable/pod{POD}"}) == 1000
    assert registry.get_sample_value("shmwatch_cgroup_oom_kills_total",
                                     {"cgroup": f"/kubepods/burstable/pod{POD}"}) is None


HOG = ("import os, sys\n"
       "open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()))\n"
       "if len(sys.argv) > 2: open('/proc/self/comm', 'wb').write(os.fsencode(sys.argv[2]))\n"
       "print('in', flush=True); sys.stdin.readline()\n"
       "hog = []\n"
       "while True: hog.append(bytearray(1 << 20))\n")


@contextlib.contextmanager
def pod_with_a_container(container_suffix: str = ""):
    """A pod cgroup and a container cgroup below it with a 32 MiB limit, as the kubelet's
    cgroupfs driver lays them out -> (pod uid, pod dir, container dir, pod cgroup path)."""
    if not os.path.exists(os.path.join(V1_ROOT, "memory.usage_in_bytes")):
        prerequisite_missing("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    uid = str(uuid.uuid4())
    pod_dir = os.path.join(V1_ROOT, "kubepods", "burstable", f"pod{uid}")
    ctr_dir = os.path.join(pod_dir, "c0ffee" + uuid.uuid4().hex[:10] + container_suffix)
    made = [d for d in (os.path.join(V1_ROOT, "kubepods"), os.path.join(V1_ROOT, "kubepods", "burstable"))
            if not os.path.isdir(d)]
    os.makedirs(ctr_dir)
    with open(os.path.join(ctr_dir, "memory.limit_in_bytes"), "w") as f:
        f.write(str(32 * MiB))
    try:
        yield uid, pod_dir, ctr_dir, f"/kubepods/burstable/pod{uid}"
    finally:
        remove_cgroup(ctr_dir)
        remove_cgroup(pod_dir)
        for directory in reversed(made):
            remove_cgroup(directory)


def kill_a_hog_in(ctr_dir: str, comm: str = "") -> subprocess.Popen:
    """A process that joins the container's cgroup (and names itself `comm`) and allocates
    until the kernel kills it."""
    argv = [sys.executable, "-c", HOG, ctr_dir] + ([comm] if comm else [])
    hog = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert hog.stdout.readline() == b"in\n"
        hog.stdin.write(b"go\n")
        hog.stdin.flush()
        assert hog.wait(20) == -9
    finally:
        if hog.poll() is None:  # not killed: do not leave it in the cgroup we remove
            hog.kill()
            hog.wait()
    return hog


@needs_root
def test_real_kill_counts_for_the_pod_after_the_container_cgroup_is_gone():
    """A pod cgroup and a container cgroup below it (as the kubelet's cgroupfs driver lays
    them out), a process in the container over its 32 MiB limit: the kernel kills it and
    counts it in the container's memcg only; the container's cgroup is removed. Node mode
    (a process on the host, reading /dev/kmsg) counts the kill for the pod, logs it, and
    `shmwatch check` lists it."""
    with pod_with_a_container() as (uid, pod_dir, ctr_dir, pod_cgroup):
        with Exporter("--mode=node", "--no-collector.gpu", "--no-collector.segments", "--poll-interval=200ms") as ex:
            ex.wait_for(lambda s: value(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == 0, timeout=10)
            hog = kill_a_hog_in(ctr_dir)
            remove_cgroup(ctr_dir)
            assert not os.path.exists(ctr_dir)
            s = ex.wait_for(lambda s: value(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == 1,
                            timeout=5)
            # The pod's series, named by its pod_uid alone (its cgroup's path would say it again).
            assert [labels for labels, _ in select(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid)] == [
                {"pod_uid": uid}]
            # The pod's own v1 counter never saw it: the kernel log did.
            with open(os.path.join(pod_dir, "memory.oom_control")) as f:
                assert "oom_kill 0" in f.read()
            with open(ex.stderr_path, errors="replace") as f:  # the whole log: node mode logs much
                logged = [line for line in f if f"pid {hog.pid} " in line and "OOM kill" in line]
            assert len(logged) == 1 and f"pod {uid}" in logged[0] and "shmem-rss 0.0MiB" in logged[0], ex.log()
        report = subprocess.run([sys.executable, "-m", "exporter", "check", "--mode=node", "--no-collector.gpu",
                                 "--no-collector.segments", "--output=json"], cwd=REPO, capture_output=True,
                                text=True, timeout=60)
        kills = [k for k in json.loads(report.stdout)["oom_kills"] if k["pid"] == hog.pid]
        assert len(kills) == 1 and kills[0]["pod_uid"] == uid and kills[0]["task_memcg"].startswith(pod_cgroup)
        assert kills[0]["anon_rss_bytes"] > 16 * MiB and kills[0]["age_seconds"] < 60


@needs_root
def test_a_kill_names_its_process_and_cgroup_as_they_are_not_as_the_kernel_log_escapes_them():
    """/dev/kmsg writes a backslash, control bytes and non-ASCII as \\xNN: a victim named
    'hog\\é\\x01' in a container cgroup whose name ends in 'é' is reported under those names
    (check's JSON), so its cgroup matches cgroupfs' and check shows each byte escaped once."""
    comm = "hog\\é\x01"
    with pod_with_a_container(container_suffix="é") as (uid, pod_dir, ctr_dir, pod_cgroup):
        with Exporter("--mode=node", "--no-collector.gpu", "--no-collector.segments", "--poll-interval=200ms") as ex:
            ex.wait_for(lambda s: value(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == 0, timeout=10)  # the pod names its cgroup
            hog = kill_a_hog_in(ctr_dir, comm=comm)
            ex.wait_for(lambda s: value(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == 1, timeout=5)
        report = subprocess.run([sys.executable, "-m", "exporter", "check", "--mode=node", "--no-collector.gpu",
                                 "--no-collector.segments", "--output=json"], cwd=REPO, capture_output=True,
                                text=True, timeout=60)
        [kill] = [k for k in json.loads(report.stdout)["oom_kills"] if k["pid"] == hog.pid]
        assert kill["comm"] == comm
        assert kill["task_memcg"] == ctr_dir[len(V1_ROOT):]
        text = subprocess.run([sys.executable, "-m", "exporter", "check", "--mode=node", "--no-collector.gpu",
                               "--no-collector.segments"], cwd=REPO, capture_output=True, text=True, timeout=60)
        [line] = [line for line in text.stdout.splitlines() if f"pid {hog.pid}" in line]
        assert "hog" in line and "x5c" not in line and "xc3" not in line, line


@needs_root
def test_without_the_kernel_log_container_counts_are_kept_for_the_pod():
    """--no-collector.oom (the unprivileged DaemonSet): the container cgroup's own v1 counter,
    seen while it exists, is kept for the pod after the container's cgroup is removed."""
    with pod_with_a_container() as (uid, _, ctr_dir, _), \
            Exporter("--mode=node", "--no-collector.gpu", "--no-collector.segments", "--no-collector.oom",
                     "--poll-interval=200ms") as ex:
        ex.wait_for(lambda s: value(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == 0, timeout=10)
        kill_a_hog_in(ctr_dir)
        ex.wait_for(lambda s: value(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == 1, timeout=20)
        remove_cgroup(ctr_dir)
        assert not os.path.exists(ctr_dir)
        for _ in range(5):  # polls after the container's cgroup is gone
            time.sleep(0.25)
            assert value(ex.scrape(), "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == 1


class Discovered:
    """The mount set discovery last published to a step: `clear()` publishes an empty one."""

    def __init__(self, step, targets):
        self.step = step
        self.publish(targets)

    def publish(self, targets):
        from exporter.model.types import MountSet, Observation
        self.step.accept(Observation("discovery", MountSet(list(targets)), None, 0.0))

    def clear(self):
        self.publish([])


def step_with_pod_mount(uid: str) -> "Tuple[ModelStep, Discovered]":
    """A node-mode ModelStep fed by hand: the cgroup and oom sources, and one mount of pod
    `uid` that discovery sees until `.clear()`."""
    from exporter.model.state import StateStore
    from exporter.model.step import ModelStep
    from exporter.model.types import Target

    step = ModelStep(["cgroup", "oom"], StateStore(), node_mode=True)
    return step, Discovered(step, [Target(f"/var/lib/kubelet/pods/{uid}/volumes/dshm", {"pod_uid": uid})])


def oom_series(step, *observations):
    from exporter.model.types import Observation
    for source, result in observations:
        step.accept(Observation(source, result, None if result is not None else "EIO", 0.0))
    return sorted((c.cgroup, c.kills) for c in step.current().oom_kills)


def test_oom_series_never_go_down_while_the_pod_is_there():
    """A container's count gone with its cgroup, or one failed read of the pod's cgroup, must
    not lower the series: Prometheus would take 2 -> 1 for a reset and PodOomKilled would fire."""
    pod = f"/kubepods/burstable/pod{POD}"

    def v1_pod(containers=()):  # v1: the pod's own counter says 0, each container's its own
        return [CgroupMemory(pod, 1, 0, None, 0, None, 0, "none", pod_uid=POD, child_oom_kills=containers)]

    step, targets = step_with_pod_mount(POD)
    kill = [k for k in fixture_kills() if k.pod_uid == POD][0]
    assert oom_series(step, ("oom", OomReports((kill,), 0))) == [(kill.pod_cgroup, 1)]
    assert oom_series(step, ("cgroup", v1_pod(((pod + "/c1", 2),)))) == [(pod, 2)]
    assert oom_series(step, ("cgroup", v1_pod())) == [(pod, 2)]  # the container's cgroup gone
    # The pod's cgroup failed to read: the kernel log alone says 1; the series stays at 2.
    assert oom_series(step, ("cgroup", None)) == [(pod, 2)]

    step, targets = step_with_pod_mount(POD)  # no kill in the kernel log: the counter's alone
    assert oom_series(step, ("oom", OomReports((), 0)), ("cgroup", v1_pod(((pod + "/c1", 2),)))) == [(pod, 2)]
    assert oom_series(step, ("cgroup", None)) == [(pod, 2)]  # its mount is still there
    targets.clear()
    assert oom_series(step, ("cgroup", None)) == []  # the pod is gone: so is its series


def test_oom_counts_made_again_when_a_count_moves_while_the_cgroups_stand():
    """A counter that moves, with the same cgroups standing, shows at the next build."""
    step, _ = step_with_pod_mount(POD)
    pod = f"/kubepods/burstable/pod{POD}"

    def v2_pod(kills):
        return [CgroupMemory(pod, 2, 0, None, 0, None, kills, "none", pod_uid=POD)]

    assert oom_series(step, ("cgroup", v2_pod(1))) == [(pod, 1)]
    assert oom_series(step, ("cgroup", v2_pod(1))) == [(pod, 1)]
    assert oom_series(step, ("cgroup", v2_pod(3))) == [(pod, 3)]
    assert oom_series(step, ("cgroup", v2_pod(2))) == [(pod, 3)]  # a counter never goes down


def test_oom_counts_with_a_logged_kill_are_reused_while_nothing_moved():
    """The counts are made once for the same cgroups, pods and kills, also after a kill in the
    kernel log (every build walks each cgroup's lineage otherwise)."""
    step, _ = step_with_pod_mount(POD)
    pod = f"/kubepods/burstable/pod{POD}"
    cgroups = [CgroupMemory(pod, 2, 0, None, 0, None, 1, "none", pod_uid=POD)]
    kill = [k for k in fixture_kills() if k.pod_uid == POD][0]
    oom_series(step, ("oom", OomReports((kill,), 0)), ("cgroup", cgroups))
    first = step.current().oom_kills
    assert oom_series(step, ("cgroup", list(cgroups))) == [(pod, 1)]
    assert step.current().oom_kills is first
