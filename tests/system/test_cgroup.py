"""Memory cgroup: v2 on fixture trees; v1 with a real cgroup, a real tmpfs fill and a real OOM kill."""
import os
import signal
import subprocess
import sys
import uuid

import pytest

from exporter.collectors.cgroup import CgroupCollector
from exporter.host.paths import Paths
from tests.conftest import EVERY_FAMILY, Exporter, mounted_tmpfs, needs_root, prerequisite_missing, remove_cgroup, value

MiB = 1 << 20
V1_ROOT = "/sys/fs/cgroup/memory"


KTHREADD_STAT = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 2 0 0\n"  # flags: PF_KTHREAD


def v2_tree(tmp_path, cgroup, files, proc_cgroup=None):
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(proc_cgroup or f"0::{cgroup}\n")
    # This procfs mounted without hidepid (tests.helpers.FakeProc's line): with no mountinfo
    # how it hides pids is unknown, and a container's lone view is not "no workload" but doubt.
    root = os.path.realpath(tmp_path / "proc")
    (proc / "mountinfo").write_text(f"99 1 0:21 / {root} rw,nosuid - proc proc rw,hidepid=0\n")
    # kthreadd listed: the host's PID namespace, where "our own cgroup" is the default.
    (tmp_path / "proc" / "2").mkdir()
    (tmp_path / "proc" / "2" / "stat").write_text(KTHREADD_STAT)
    directory = tmp_path / "sys" / "fs" / "cgroup" / cgroup.lstrip("/")
    directory.mkdir(parents=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return Paths(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys"))


V2_FILES = {
    "memory.current": "3221225472\n",
    "memory.max": "8589934592\n",
    "memory.stat": "anon 2147483648\nfile 1073741824\nshmem 805306368\ninactive_file 268435456\n",
    "memory.events": "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\n",
}


@pytest.mark.parametrize("cgroup", [
    # systemd driver (kubelet --cgroup-driver=systemd, the default since 1.22)
    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f1e2d3c.slice/cri-containerd-abc.scope",
    # cgroupfs driver
    "/kubepods/burstable/pod0f1e2d3c/abc",
])
def test_v2_layouts(tmp_path, cgroup):
    result = CgroupCollector(v2_tree(tmp_path, cgroup, V2_FILES)).collect()[0]
    assert (result.cgroup, result.version) == (cgroup, 2)
    assert result.usage_bytes == 3 << 30 and result.limit_bytes == 8 << 30
    assert result.working_set_bytes == (3 << 30) - (256 << 20)
    assert result.shmem_bytes == 768 << 20 and result.oom_kills == 1 and result.limit_source == "self"


def test_v2_unlimited_and_missing_files(tmp_path):
    files = {"memory.current": "1000\n", "memory.max": "max\n", "memory.stat": "anon 1000\n"}
    result = CgroupCollector(v2_tree(tmp_path, "/a", files)).collect()[0]
    assert result.limit_bytes is None and result.limit_source == "none"
    assert result.oom_kills is None and result.shmem_bytes is None and result.working_set_bytes == 1000


def test_flag_supplies_the_limit(tmp_path):
    files = {"memory.current": "1000\n", "memory.max": "max\n", "memory.stat": "inactive_file 0\n"}
    result = CgroupCollector(v2_tree(tmp_path, "/a", files), limit_override=4000).collect()[0]
    assert result.limit_bytes == 4000 and result.limit_source == "flag"


def test_v2_without_memory_controller_is_an_error(tmp_path):
    paths = v2_tree(tmp_path, "/a", {"cgroup.procs": ""})
    with pytest.raises(FileNotFoundError, match="no memory cgroup"):
        CgroupCollector(paths).collect()


def test_no_limit_exports_no_ratio(tmp_path):
    from exporter.collectors.cgroup import CgroupCollector as C
    from tests.helpers import registry_for
    files = {"memory.current": "1000\n", "memory.max": "max\n", "memory.stat": "inactive_file 0\n"}
    reg, _ = registry_for(C(v2_tree(tmp_path, "/a", files)))
    assert reg.get_sample_value("shmwatch_cgroup_memory_usage_bytes", {"cgroup": "/a"}) == 1000
    assert reg.get_sample_value("shmwatch_oom_risk_ratio", {"cgroup": "/a"}) is None
    assert reg.get_sample_value("shmwatch_cgroup_memory_limit_bytes", {"cgroup": "/a"}) is None


# --- real v1 cgroup -----------------------------------------------------------------------

FILLER = r"""
import os, sys
with open(sys.argv[1] + "/cgroup.procs", "w") as f:
    f.write(str(os.getpid()))
print("ready", flush=True)
step = 0
for line in sys.stdin:
    fd = os.open(os.path.join(sys.argv[2], "psm_fill_%d" % step), os.O_CREAT | os.O_WRONLY, 0o600)
    chunk = b"\1" * (1 << 20)
    for _ in range(8):
        os.write(fd, chunk)
    os.close(fd)
    step += 1
    print("done", step, flush=True)
"""


@pytest.fixture
def v1_cgroup():
    if not os.path.exists(os.path.join(V1_ROOT, "memory.usage_in_bytes")):
        prerequisite_missing("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    name = f"shmwatch-test-{uuid.uuid4().hex[:8]}"
    directory = os.path.join(V1_ROOT, name)
    os.mkdir(directory)
    with open(os.path.join(directory, "memory.limit_in_bytes"), "w") as f:
        f.write(str(64 * MiB))
    try:
        yield "/" + name, directory
    finally:
        # A test that failed midway may leave its processes here: a cgroup with processes in
        # it cannot be removed.
        with open(os.path.join(directory, "cgroup.procs")) as f:
            for pid in f.read().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        remove_cgroup(directory)


def ratio(samples, name, **labels):
    v = value(samples, name, **labels)
    assert v is not None, f"{name} {labels} missing"
    return v


@needs_root
def test_real_fill_and_oom_kill(v1_cgroup):
    cgroup, directory = v1_cgroup
    with mounted_tmpfs("128m") as shm:
        filler = subprocess.Popen([sys.executable, "-c", FILLER, directory, shm], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE)
        try:
            assert filler.stdout.readline().startswith(b"ready")
            with Exporter(f"--shm.mount={shm}", f"--cgroup.path={cgroup}", "--no-collector.gpu",
                          "--poll-interval=100ms", EVERY_FAMILY) as exporter:
                base = exporter.scrape()
                shmem0 = ratio(base, "shmwatch_cgroup_memory_shmem_bytes", cgroup=cgroup)
                kills0 = ratio(base, "shmwatch_cgroup_oom_kills_total", cgroup=cgroup)
                assert ratio(base, "shmwatch_cgroup_memory_limit_bytes", cgroup=cgroup) == 64 * MiB
                for step in (1, 2, 3, 4):
                    filler.stdin.write(b"go\n")
                    filler.stdin.flush()
                    assert filler.stdout.readline().split() == [b"done", str(step).encode()]

                    def caught_up(s, step=step):
                        # Two sources, polled apart: wait for both (the mount was one step behind once).
                        got = value(s, "shmwatch_cgroup_memory_shmem_bytes", cgroup=cgroup) or 0
                        used = value(s, "shmwatch_mount_used_bytes", mount=shm) or 0
                        return abs(got - shmem0 - step * 8 * MiB) <= MiB and abs(used - step * 8 * MiB) <= MiB
                    s = exporter.wait_for(caught_up, timeout=30)
                    usage = ratio(s, "shmwatch_cgroup_memory_usage_bytes", cgroup=cgroup)
                    ws = ratio(s, "shmwatch_cgroup_memory_working_set_bytes", cgroup=cgroup)
                    used = ratio(s, "shmwatch_mount_used_bytes", mount=shm)
                    assert usage >= step * 8 * MiB and abs(used - step * 8 * MiB) <= MiB
                    # Filling the 128 MiB mount would need more than the 64 MiB limit: above 1.
                    projection = ratio(s, "shmwatch_shm_oom_projection_ratio", mount=shm, cgroup=cgroup)
                    assert projection == pytest.approx((max(0, ws - used) + 128 * MiB) / (64 * MiB), rel=0.1)
                    assert projection > 1
                    assert ratio(s, "shmwatch_oom_risk_ratio", cgroup=cgroup) == pytest.approx(ws / (64 * MiB), rel=0.1)
                    # What the limit leaves for shm is less than the tmpfs size.
                    assert ratio(s, "shmwatch_mount_effective_size_bytes", mount=shm) < 128 * MiB
                # Keep filling: the cgroup runs out before the tmpfs does, and the OOM killer acts.
                for _ in range(10):
                    try:
                        filler.stdin.write(b"go\n")
                        filler.stdin.flush()
                    except BrokenPipeError:
                        break
                    if not filler.stdout.readline():
                        break
                assert filler.wait(30) == -9  # SIGKILL from the OOM killer
                s = exporter.wait_for(
                    lambda s: (value(s, "shmwatch_cgroup_oom_kills_total", cgroup=cgroup) or 0) > kills0, timeout=30)
                assert ratio(s, "shmwatch_mount_used_bytes", mount=shm) < 128 * MiB  # tmpfs never said ENOSPC
        finally:
            filler.kill()  # already dead when the OOM killer acted; not when the test failed first
            filler.wait()
            for name in os.listdir(shm):
                os.unlink(os.path.join(shm, name))


@needs_root
def test_target_process_in_another_cgroup(v1_cgroup):
    cgroup, directory = v1_cgroup
    marker = f"vllm-serve-{uuid.uuid4().hex[:6]}"
    # cgroup v1 leaves a moved process's pages charged where they were first touched: the
    # child allocates only once it is in the test's cgroup, so that cgroup's usage is its own.
    allocate_after_move = (
        "import sys, time; sys.stdin.readline(); held = bytearray(8 << 20); "
        "print('allocated', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", allocate_after_move, marker],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with open(os.path.join(directory, "cgroup.procs"), "w") as f:
            f.write(str(child.pid))
        child.stdin.write("moved\n")
        child.stdin.flush()
        assert child.stdout.readline() == "allocated\n"
        with mounted_tmpfs("16m") as shm, Exporter(f"--shm.mount={shm}", f"--cgroup.target-process={marker}",
                                                   "--no-collector.gpu", EVERY_FAMILY) as exporter:
            s = exporter.scrape()
        assert value(s, "shmwatch_cgroup_memory_limit_bytes", cgroup=cgroup) == 64 * MiB
        assert value(s, "shmwatch_cgroup_memory_usage_bytes", cgroup=cgroup) > 0
    finally:
        child.kill()
        child.wait()


def test_cgroup_outside_our_namespace_is_refused(tmp_path):
    paths = v2_tree(tmp_path, "/a", V2_FILES, proc_cgroup="0::/../cri-containerd-other.scope\n")
    with pytest.raises(LookupError, match="outside this container's cgroup namespace"):
        CgroupCollector(paths).collect()


@needs_root
def test_a_pod_removed_mid_walk_leaves_the_others(tmp_path):
    """Real v1 pod cgroups. One is removed after the walk listed it and before it was read:
    the collector still succeeds with the other pods. Then the same race for real: a pod
    created and removed in a loop while node mode collects over and over; the stable pods
    are in every result and no collect fails."""
    import threading
    from exporter.host.paths import Paths
    if not os.path.exists(os.path.join(V1_ROOT, "memory.usage_in_bytes")):
        prerequisite_missing("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    base = os.path.join(V1_ROOT, "kubepods", "burstable")
    made = [d for d in (os.path.join(V1_ROOT, "kubepods"), base) if not os.path.isdir(d)]
    uids = [str(uuid.uuid4()) for _ in range(3)]
    dirs = [os.path.join(base, f"pod{u}") for u in uids]
    flapping = os.path.join(base, f"pod{uuid.uuid4()}")
    stop = threading.Event()
    try:
        for d in dirs:
            os.makedirs(d)
        collector = CgroupCollector(Paths(), node_mode=True)
        listed = [p for p in collector.pod_cgroups() if p.pod_uid in uids]
        assert [p.pod_uid for p in listed] == sorted(uids)
        remove_cgroup(dirs[1])
        assert [c.pod_uid for c in collector.read_pods(listed)] == [u for u in sorted(uids) if u != uids[1]]

        def flap():
            while not stop.is_set():
                os.mkdir(flapping)
                remove_cgroup(flapping)
        thread = threading.Thread(target=flap, daemon=True)
        thread.start()
        stable = {uids[0], uids[2]}
        for _ in range(300):
            assert stable <= {c.pod_uid for c in collector.collect()}
    finally:
        stop.set()
        for d in dirs + [flapping]:
            remove_cgroup(d)
        for d in reversed(made):
            remove_cgroup(d)


def test_alone_in_a_container_no_cgroup_is_passed_off_as_the_workloads(tmp_path):
    """No kernel thread listed (a container's PID namespace) and no other process in it: the
    only cgroup in sight is shmwatch's own, which is not exported under OOM-risk names."""
    paths = v2_tree(tmp_path, "/a", V2_FILES)
    os.unlink(tmp_path / "proc" / "2" / "stat")
    with pytest.raises(LookupError, match="no workload shares this PID namespace"):
        CgroupCollector(paths).collect()


@needs_root
def test_node_mode_walks_the_pod_cgroups_again_only_when_it_must(tmp_path, monkeypatch):
    """The listing of pod cgroups is kept between polls (walking 200 pods' trees each second
    cost more than reading them); a pod made (its parent's link count), a pod whose shm mount
    appeared, or one that went away makes the next poll walk again."""
    from exporter.collectors import cgroup as cgroup_mod
    from exporter.host.paths import Paths
    if not os.path.exists(os.path.join(V1_ROOT, "memory.usage_in_bytes")):
        prerequisite_missing("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    monkeypatch.setattr(cgroup_mod, "MISSING_REWALK_SECONDS", 0.0)
    base = os.path.join(V1_ROOT, "kubepods", "burstable")
    made = [d for d in (os.path.join(V1_ROOT, "kubepods"), base) if not os.path.isdir(d)]
    first, later, quiet = (str(uuid.uuid4()) for _ in range(3))
    mounts = [f"/var/lib/kubelet/pods/{first}/volumes/kubernetes.io~empty-dir/dshm"]
    try:
        os.makedirs(os.path.join(base, f"pod{first}"))
        from exporter.collectors.source import RunInput
        collector = CgroupCollector(Paths(), node_mode=True)
        walks = []
        walk = collector.pod_cgroups
        monkeypatch.setattr(collector, "pod_cgroups", lambda: walks.append(1) or walk())
        run = lambda: RunInput(mounts=tuple(mounts))  # noqa: E731  (the watched mounts, as handed to each run)
        ours = lambda: sorted(c.pod_uid for c in collector.collect(run())  # noqa: E731
                              if c.pod_uid in (first, later, quiet))
        assert ours() == [first] and len(walks) == 1
        assert ours() == [first] and len(walks) == 1, "walked again with nothing changed"
        os.makedirs(os.path.join(base, f"pod{quiet}"))  # no shm volume: found by burstable's links
        assert ours() == sorted([first, quiet]) and len(walks) == 2
        os.makedirs(os.path.join(base, f"pod{later}"))
        mounts.append(f"/var/lib/kubelet/pods/{later}/volumes/kubernetes.io~empty-dir/dshm")
        assert ours() == sorted([first, later, quiet]) and len(walks) == 3
        assert len(walks) == 3 and ours() == sorted([first, later, quiet]) and len(walks) == 3
        remove_cgroup(os.path.join(base, f"pod{quiet}"))
        assert ours() == sorted([first, later])  # the read failed: left out, and listed afresh next
        ours()
        assert len(walks) == 4
    finally:
        for uid in (first, later, quiet):
            if os.path.isdir(os.path.join(base, f"pod{uid}")):
                remove_cgroup(os.path.join(base, f"pod{uid}"))
        for d in reversed(made):
            os.rmdir(d)


@needs_root
def test_a_v1_pods_containers_are_followed_without_listing_them_every_run(monkeypatch):
    """Node mode lists a v1 pod's container cgroups again only when its link count or a
    container gone says they changed: a container added, or one replaced by another (the
    count unchanged), is in the very next read."""
    if not os.path.exists(os.path.join(V1_ROOT, "memory.oom_control")):
        prerequisite_missing(f"no cgroup v1 memory controller at {V1_ROOT}")
    uid = str(uuid.uuid4())
    pod = os.path.join(V1_ROOT, f"shmwatch-test-pod{uid}")
    made = []
    listings = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: listings.append(path) or scandir(path))
    collector = CgroupCollector(Paths(), node_mode=True)

    def containers():
        path = f"/shmwatch-test-pod{uid}"
        return [name for name, _ in collector.read(path, 1, pod, uid).child_oom_kills]

    def add(name):
        os.mkdir(os.path.join(pod, name))
        made.append(os.path.join(pod, name))

    try:
        os.mkdir(pod)
        add("a")
        assert containers() == [f"/shmwatch-test-pod{uid}/a"] and len(listings) == 1
        assert containers() == [f"/shmwatch-test-pod{uid}/a"] and len(listings) == 1  # not listed again
        add("b")
        assert containers() == [f"/shmwatch-test-pod{uid}/a", f"/shmwatch-test-pod{uid}/b"]
        remove_cgroup(os.path.join(pod, "a"))
        add("c")  # as many containers as before
        assert containers() == [f"/shmwatch-test-pod{uid}/b", f"/shmwatch-test-pod{uid}/c"]
        assert containers() == [f"/shmwatch-test-pod{uid}/b", f"/shmwatch-test-pod{uid}/c"]
        assert len(listings) == 3
    finally:
        for path in reversed(made):
            remove_cgroup(path)
        remove_cgroup(pod)


@needs_root
def test_node_mode_reads_a_steady_pod_less_often_and_a_changed_or_near_limit_one_every_poll():
    """cAdvisor's dynamic housekeeping, per pod (real v1 pod cgroups, 8 MiB of shm charged to
    each by a process that wrote it and left): a pod read the same as last time is read again
    after twice as many polls, up to POD_STRETCH_MAX; one near its limit every poll; a jump in
    usage or a limit changed (two small files read every poll) at the next poll, and the pod
    read every poll again. With
    the kernel log not counting every kill (v1 counts one in a container's own cgroup, which
    may be gone by the next read), every pod every poll."""
    from exporter.check.thresholds import OOM_RISK_RATIO
    from exporter.collectors import cgroup as cgroup_mod

    if not os.path.exists(os.path.join(V1_ROOT, "memory.usage_in_bytes")):
        prerequisite_missing("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    assert cgroup_mod.STRETCH_BELOW_RATIO < OOM_RISK_RATIO  # read every poll before the alert
    base = os.path.join(V1_ROOT, "kubepods", "burstable")
    made = [d for d in (os.path.join(V1_ROOT, "kubepods"), base) if not os.path.isdir(d)]
    steady, near = (str(uuid.uuid4()) for _ in range(2))
    pods = {uid: os.path.join(base, f"pod{uid}") for uid in (steady, near)}
    complete = {"yes": True}
    reads = []

    def counting_collector():
        """A node-mode collector that notes each pod directory it reads into `reads`."""
        fresh = CgroupCollector(Paths(), node_mode=True)
        read = fresh.read
        fresh.read = lambda path, version, directory, *a: reads.append(directory) or read(path, version, directory, *a)
        return fresh

    collector = counting_collector()

    def polls(n):
        """-> per poll, the pods read; and the last poll's results by pod."""
        seen = []
        for _ in range(n):
            reads.clear()
            found = {c.pod_uid: c for c in collector.read_pods(listed, stretch=complete["yes"])}
            seen.append({uid for uid, d in pods.items() if d in reads})
        return seen, found

    with mounted_tmpfs("32m") as shm:
        try:
            for uid, pod in pods.items():
                os.makedirs(pod)
                subprocess.run(["sh", "-c", f"echo $$ > {pod}/cgroup.procs && exec head -c {8 * MiB} /dev/zero "
                                            f"> {shm}/{uid}"], check=True)
            usage = int(open(os.path.join(pods[near], "memory.usage_in_bytes")).read())
            with open(os.path.join(pods[near], "memory.limit_in_bytes"), "w") as f:
                f.write(str(int(usage / 0.9)))  # near its limit, not at it
            listed = [p for p in collector.pod_cgroups() if p.pod_uid in pods]
            steady_usage = os.path.join(pods[steady], "memory.usage_in_bytes")
            for _attempt in range(3):
                # v1's usage moves by itself: another cgroup charging on a CPU drains this one's
                # per-CPU precharge (up to 64 pages). A changed usage is rightly read whole
                # again, so the schedule is asserted over 70 polls the usage stayed put.
                before = open(steady_usage).read()
                seen, found = polls(70)
                if open(steady_usage).read() == before:
                    break
                collector.close()
                collector = counting_collector()
            assert [i + 1 for i, s in enumerate(seen) if steady in s] == [1, 2, 4, 8, 16, 32, 64]
            assert cgroup_mod.POD_STRETCH_MAX == 32
            assert all(near in s for s in seen)
            assert found[steady].shmem_bytes >= 8 * MiB and found[near].limit_bytes == int(usage / 0.9) // 4096 * 4096
            # Stretched (next read due at poll 96), its usage jumps: read whole at the next poll.
            subprocess.run(["sh", "-c", f"echo $$ > {pods[steady]}/cgroup.procs && exec head -c {4 * MiB} "
                                        f"/dev/zero > {shm}/{steady}.more"], check=True)
            seen, found = polls(1)
            assert seen == [{steady, near}] and found[steady].shmem_bytes >= 12 * MiB
            assert [steady in s for s in polls(4)[0]] == [True, False, True, False]  # stretched again
            with open(os.path.join(pods[steady], "memory.limit_in_bytes"), "w") as f:
                f.write(str(1 << 31))  # resized in place, 2 polls before its next read is due
            seen, found = polls(1)
            assert seen == [{steady, near}] and found[steady].limit_bytes == 1 << 31
            # Changed: read the next poll again, then half as often again.
            assert [steady in s for s in polls(4)[0]] == [True, False, True, False]
            # The QoS slice's limit lowered (the kubelet's QOSReserved): binding at the next poll.
            with open(os.path.join(base, "memory.limit_in_bytes"), "w") as f:
                f.write(str(1 << 30))
            seen, found = polls(1)
            assert steady in seen[0] and found[steady].limit_bytes == 1 << 30
            assert found[steady].limit_source == "ancestor"
            complete["yes"] = False
            assert all(s == {steady, near} for s in polls(4)[0])
        finally:
            with open(os.path.join(base, "memory.limit_in_bytes"), "w") as f:
                f.write("-1")
            collector.close()
            for name in os.listdir(shm):
                os.unlink(os.path.join(shm, name))
            for pod in pods.values():
                remove_cgroup(pod)
            for d in reversed(made):
                remove_cgroup(d)
