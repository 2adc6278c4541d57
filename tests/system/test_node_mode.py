"""Node mode: one shmwatch per node finds every pod's and container's shm and memory cgroup."""
import contextlib
import os
import subprocess
import sys
import time
import uuid

import pytest

from exporter.model.catalogue import BY_NAME, node_labels
from exporter.collectors.cgroup import CgroupCollector
from exporter.collectors.shm_mount import ShmMountCollector
from exporter.collectors.discovery import MountDiscovery, discover
from exporter.host.mountinfo import MountTable, parse_mountinfo, strip_rootfs
from exporter.host.paths import Paths
from exporter.collectors.source import RunInput
from tests.conftest import (FIXTURES, Exporter, Peer, fallocate, in_own_mount_namespace, mounted_tmpfs, needs_root,
                            prerequisite_missing, remove_pod_cgroups, select, value)
from tests.helpers import V1_MEMORY

POD1, POD2 = "0f1e2d3c-aaaa-bbbb-cccc-000000000001", "0f1e2d3c-aaaa-bbbb-cccc-000000000002"


def test_discovery_on_a_host_with_every_runtime_layout():
    with open(os.path.join(FIXTURES, "node", "mountinfo")) as f:
        targets = {t.mount: t.labels for t in discover(parse_mountinfo(f.read()))}
    kubelet = "/var/lib/kubelet/pods/{}/volumes/kubernetes.io~empty-dir/{}"
    assert targets[kubelet.format(POD1, "dshm")] == {"pod_uid": POD1, "volume": "dshm", "container_id": ""}
    assert targets[kubelet.format(POD2, "shm")]["volume"] == "shm"
    assert kubelet.format(POD2, "cache") not in targets  # a disk-backed emptyDir is no shm
    containerd = [m for m in targets if "/io.containerd.grpc.v1.cri/sandboxes/" in m]
    assert len(containerd) == 2 and all(targets[m]["container_id"] for m in containerd)
    assert targets["/run/containers/storage/overlay-containers/" + "c0ffee00" * 8 + "/userdata/shm"][
        "container_id"] == "c0ffee00" * 8
    docker = [m for m in targets if m.startswith("/var/lib/docker/")]
    assert docker == ["/var/lib/docker/containers/" + "d0d0d0d0e1e1e1e1f2f2f2f2a3a3a3a3b4b4b4b4c5c5c5c5d6d6d6d6e7e7e7e7"
                      "/mounts/shm"]
    assert targets["/dev/shm"] == {"pod_uid": "", "volume": "", "container_id": ""}
    assert "/run" not in targets and not [m for m in targets if "projected" in m]
    assert len(targets) == 7  # 2 emptyDirs, 2 containerd, 1 CRI-O, 1 Docker, the host's /dev/shm


def cgroup_tree(root, layout, version, uids):
    """Pods' memory cgroups in one layout: cgroupfs or systemd, v1 or v2."""
    base = os.path.join(root, "fs", "cgroup", "memory") if version == 1 else os.path.join(root, "fs", "cgroup")
    made = []
    for i, uid in enumerate(uids):
        qos = ("burstable", "besteffort", "")[i % 3]
        if layout == "cgroupfs":
            path = os.path.join(base, "kubepods", qos, f"pod{uid}") if qos else os.path.join(base, "kubepods", f"pod{uid}")
        else:
            u = uid.replace("-", "_")
            parts = ["kubepods.slice"] + ([f"kubepods-{qos}.slice", f"kubepods-{qos}-pod{u}.slice"] if qos
                                           else [f"kubepods-pod{u}.slice"])
            path = os.path.join(base, *parts)
        os.makedirs(os.path.join(path, "cri-containerd-abc.scope"))  # a container below the pod
        files = ({"memory.usage_in_bytes": "1000", "memory.limit_in_bytes": "4000",
                  "memory.stat": "total_inactive_file 100\ntotal_shmem 300\n", "memory.oom_control": "oom_kill 1\n"}
                 if version == 1 else
                 {"memory.current": "1000", "memory.max": "4000", "memory.stat": "inactive_file 100\nshmem 300\n",
                  "memory.events": "oom_kill 1\n"})
        for target in (path, os.path.join(path, "cri-containerd-abc.scope")):
            for name, text in files.items():
                with open(os.path.join(target, name), "w") as f:
                    f.write(text)
        made.append(path)
    return made


@pytest.mark.parametrize("layout", ["cgroupfs", "systemd"])
@pytest.mark.parametrize("version", [1, 2])
def test_pod_cgroups_in_each_layout(tmp_path, layout, version):
    uids = [str(uuid.UUID(int=i + 1)) for i in range(3)]
    cgroup_tree(str(tmp_path / "sys"), layout, version, uids)
    pods = CgroupCollector(Paths(sysfs=str(tmp_path / "sys")), node_mode=True).collect()
    assert sorted(p.pod_uid for p in pods) == sorted(uids)  # pods only, not their containers
    assert all(p.version == version and p.working_set_bytes == 900 and p.limit_bytes == 4000
               and p.shmem_bytes == 300 and p.oom_kills == 1 for p in pods)


def test_node_labels_in_the_catalogue():
    assert node_labels(BY_NAME["shmwatch_mount_used_bytes"]) == ("pod_uid", "volume", "container_id")
    assert node_labels(BY_NAME["shmwatch_oom_risk_ratio"]) == ("pod_uid",)
    # SysV is per IPC namespace in node mode: which one, and whose.
    assert node_labels(BY_NAME["shmwatch_sysv_bytes"]) == ("ipc_namespace", "pod_uid", "container_id")


# --- real mounts, a real exporter -----------------------------------------------------------
def check_node_exposition(text):
    """Every family in the catalogue, with its labels plus node mode's, none of them empty and
    none saying what another says: a mount named by its pod and volume (or its container) has
    no `mount`, a pod's cgroup no `cgroup`; a segment nobody holds no owner. promtool-clean."""
    from prometheus_client.parser import text_string_to_metric_families
    from tests.conftest import promtool_check_metrics
    for family in text_string_to_metric_families(text):
        entry = BY_NAME.get(family.name) or BY_NAME.get(family.name + "_total")
        assert entry is not None, family.name
        for sample in family.samples:
            labels = sample.labels
            said = (sample.name, sorted(labels.items()))
            assert all(labels.values()) and set(labels) <= set(entry.labels + node_labels(entry)), said
            named_by_pod = {"mount"} if {"volume", "container_id"} & set(labels) else set()
            named_by_pod |= {"cgroup"} if "pod_uid" in labels else set()
            assert set(entry.labels) - set(labels) <= named_by_pod | {"owner"}, said
            assert not named_by_pod & set(labels), said
    result = promtool_check_metrics(text)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_root
def test_real_node_mode(tmp_path):
    root = str(tmp_path)
    uid1, uid2 = str(uuid.uuid4()), str(uuid.uuid4())
    sandbox, docker_id = uuid.uuid4().hex * 2, uuid.uuid4().hex * 2
    paths = {
        "pod1": f"{root}/var/lib/kubelet/pods/{uid1}/volumes/kubernetes.io~empty-dir/dshm",
        "pod2": f"{root}/var/lib/kubelet/pods/{uid2}/volumes/kubernetes.io~empty-dir/shm",
        "containerd": f"{root}/run/containerd/io.containerd.grpc.v1.cri/sandboxes/{sandbox}/shm",
        "docker": f"{root}/var/lib/docker/containers/{docker_id}/mounts/shm",
    }
    # The pods' memory cgroups, real ones, where the v1 memory controller is mounted.
    cgroups = []
    # Without v1 the pod-cgroup join below cannot be checked: said at the end (a skip, a
    # failure under CI), after the mount checks have run.
    if os.path.exists(os.path.join(V1_MEMORY, "memory.usage_in_bytes")):
        for uid in (uid1, uid2):
            path = os.path.join(V1_MEMORY, "kubepods", "burstable", f"pod{uid}")
            os.makedirs(path)
            with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
                f.write(str(256 << 20))
            cgroups.append(path)
    mounts = {name: mounted_tmpfs("32m", path=path) for name, path in paths.items()}
    for cm in mounts.values():
        cm.__enter__()
    try:
        fallocate(os.path.join(paths["pod1"], "psm_pod1"), 4 << 20)
        with Peer(paths["pod2"], "mapped", "nccl-pod2ab", str(2 << 20)) as peer, \
                Exporter("--mode=node", "--no-collector.gpu", "--poll-interval=200ms",
                         "--inventory-interval=500ms", "--metric-opt-in-list=shmwatch_.*") as exporter:
            text = exporter.scrape_text()
            s = exporter.scrape()
            check_node_exposition(text)  # every family: the opt-in ones too
            assert value(s, "shmwatch_mount_size_bytes", pod_uid=uid1, volume="dshm") == 32 << 20
            assert value(s, "shmwatch_mount_used_bytes", pod_uid=uid1) == 4 << 20
            assert value(s, "shmwatch_mount_size_bytes", container_id=sandbox) == 32 << 20
            assert value(s, "shmwatch_mount_size_bytes", container_id=docker_id) == 32 << 20
            assert not [k for k in s if paths["pod1"] in str(k)]  # a pod's path is not a label
            assert value(s, "shmwatch_segment_bytes", pod_uid=uid2, state="linked", **{"class": "nccl"}) == 2 << 20
            # A process by its name and pod, not its pid.
            assert value(s, "shmwatch_process_shm_bytes", pod_uid=uid2, comm=peer.comm) == 2 << 20
            if cgroups:
                assert value(s, "shmwatch_cgroup_memory_limit_bytes", pod_uid=uid1) == 256 << 20
                # pod1's 32 MiB emptyDir against its 256 MiB limit: its own projection, joined by pod UID.
                assert value(s, "shmwatch_shm_oom_projection_ratio", pod_uid=uid1, volume="dshm") is not None
            # A pod's volume goes away: its mount's series go with it.
            mounts.pop("pod1").__exit__(None, None, None)
            s = exporter.wait_for(lambda s: not select(s, "shmwatch_mount_size_bytes", pod_uid=uid1), timeout=10)
            assert not [k for k in s if dict(k[1]).get("pod_uid") == uid1 and "volume" in dict(k[1])]
            assert value(s, "shmwatch_mount_size_bytes", pod_uid=uid2, volume="shm") == 32 << 20
    finally:
        for cm in mounts.values():
            cm.__exit__(None, None, None)
        remove_pod_cgroups(cgroups)
    if not cgroups:
        prerequisite_missing(f"no cgroup v1 memory controller at {V1_MEMORY}: node mode's pod-cgroup join "
                             f"was not checked (the mount checks passed)")


def test_rootfs_prefix_is_stripped_from_our_own_mountinfo():
    # Our own view (the fallback): the host's / is mounted at /host, its mounts below it;
    # the DaemonSet container's own /dev/shm is not the host's and is left out.
    text = (f"20 1 0:30 / / rw - overlay overlay rw\n"
            f"21 20 8:1 / /host ro - ext4 /dev/sda1 ro\n"
            f"22 21 0:40 / /host/var/lib/kubelet/pods/{POD1}/volumes/kubernetes.io~empty-dir/dshm rw - tmpfs tmpfs rw\n"
            f"23 20 0:41 / /dev/shm rw - tmpfs shm rw,size=65536k\n")
    stripped = strip_rootfs(parse_mountinfo(text), "/host/")
    assert [e.mount_point for e in stripped] == ["/", f"/var/lib/kubelet/pods/{POD1}/volumes/kubernetes.io~empty-dir/dshm"]
    host_view = parse_mountinfo("22 1 0:40 / /dev/shm rw - tmpfs tmpfs rw\n")  # pid 1's: as it is
    assert strip_rootfs(host_view, "/host") == host_view
    index = MountTable(Paths(), entries=stripped)
    assert index.find(f"/var/lib/kubelet/pods/{POD1}/volumes/kubernetes.io~empty-dir/dshm/x").device == "0:40"
    assert index.find("/etc/hostname").mount_point == "/"


@needs_root
def test_every_pod_mount_found_through_a_rootfs_prefixed_mountinfo(tmp_path):
    """pid 1's mountinfo unreadable: discovery falls back to ours, whose points start with
    --path.rootfs; every pod mount is still found, named as the host names it, and measured."""
    rootfs = str(tmp_path / "host")
    procfs = tmp_path / "proc"
    procfs.mkdir()
    os.symlink("/proc/self", procfs / "self")  # and no procfs/1: pid 1's cannot be read
    uids = [str(uuid.uuid4()) for _ in range(5)]
    points = [f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm" for uid in uids]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mounted_tmpfs("4m", path=rootfs))  # the host's / at --path.rootfs
        for point in points:
            stack.enter_context(mounted_tmpfs("8m", path=rootfs + point))
        paths = Paths(procfs=str(procfs), rootfs=rootfs)
        discovery = MountDiscovery(paths, [], node_mode=True)
        found = discovery.collect().mounts()
        assert sorted(m for m in found if "/kubelet/pods/" in m) == sorted(points)
        assert not [m for m in found if m.startswith(rootfs)]
        usages = ShmMountCollector(paths).collect(RunInput(mounts=tuple(found)))
        by_mount = {u.mount: u for u in usages}
        for point in points:
            usage = by_mount[point]
            assert usage.error is None and usage.fstype == "tmpfs" and usage.is_mount_point, usage
            assert usage.size_bytes == 8 << 20


@needs_root
def test_mountinfo_is_read_again_only_when_the_mount_table_changed(tmp_path):
    """procfs says when a mount table changed (POLLPRI): an unchanged one is not re-read and
    parsed every poll (10 ms at 2,000 mounts); a fixture file, which cannot say, is. A fallback
    file is read again when the last entries came from another. In a mount namespace of its
    own: the host's changes whenever docker or another test mounts."""
    point = str(tmp_path / "new")
    os.mkdir(point)
    proc = tmp_path / "proc"
    os.makedirs(proc / "1")
    os.symlink("/proc/self", proc / "self")
    fixture = proc / "1" / "mountinfo"
    fixture.write_text("1 0 0:1 / / rw - tmpfs tmpfs rw\n")
    script = f"""
import os, subprocess
from exporter.host.mountinfo import MountTable
from exporter.host.paths import Paths
points = lambda entries: [e.mount_point for e in entries]
table = MountTable(Paths(), ("self",))
first = table.read()
assert first and table.read() is None, "read again unchanged"
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", {point!r}], check=True)
changed = table.read()
assert changed is not None and {point!r} in points(changed), "a mount not seen"
assert table.read() is None, "read again unchanged after a mount"
subprocess.run(["umount", {point!r}], check=True)
after = table.read()
assert after is not None and {point!r} not in points(after), "an unmount not seen"
table, fixture = MountTable(Paths(procfs={str(proc)!r}), ("1", "self")), {str(fixture)!r}
assert points(table.read()) == points(table.read()) == ["/"], "a fixture is read every time"
os.rename(fixture, fixture + ".off")
assert len(table.read()) > 1 and table.read() is None, "pid 1's unreadable: ours, once"
os.rename(fixture + ".off", fixture)
assert points(table.read()) == ["/"], "pid 1's back"
os.rename(fixture, fixture + ".off")
assert len(table.read() or ()) > 1, "ours read again: the last entries were pid 1's"
print("ok")
"""
    in_own_mount_namespace(script)


UNSHARE_LATER = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
print("ready", flush=True)
sys.stdin.readline()
assert libc.unshare(0x08000000) == 0  # CLONE_NEWIPC, after shmwatch has seen it in the host's
shmid = libc.shmget(0, 3 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
print(shmid, flush=True)
sys.stdin.readline()
"""


@needs_root
def test_node_mode_sysv_follows_a_process_into_an_ipc_namespace_it_made_after_being_seen():
    """A process's namespace is read twice before it is trusted: `unshare --ipc` runs in the
    pid that started in the host's namespace, and a namespace read once would hide its SysV."""
    from exporter.collectors.sysv import SysvCollector
    collector = SysvCollector(Paths(), node_mode=True)
    proc = subprocess.Popen([sys.executable, "-c", UNSHARE_LATER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        host = os.readlink(f"/proc/{proc.pid}/ns/ipc")
        assert host in {shm.namespace for shm in collector.collect()}
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert int(proc.stdout.readline()) >= 0
        own = os.readlink(f"/proc/{proc.pid}/ns/ipc")
        assert own != host
        [shm] = [shm for shm in collector.collect() if shm.namespace == own]
        assert shm.readable and [s.size_bytes for s in shm.segments] == [3 << 20]
    finally:
        proc.kill()
        proc.wait()


@needs_root
def test_node_mode_watches_a_pod_volume_mounted_over_its_old_one(tmp_path):
    """The watcher skips its per-mount stat while the mount table is unchanged; a tmpfs
    mounted over a watched one changes the table, and the new one is watched at once."""
    path = f"{tmp_path}/var/lib/kubelet/pods/{uuid.uuid4()}/volumes/kubernetes.io~empty-dir/dshm"
    uid = path.split("/pods/")[1].split("/")[0]
    with mounted_tmpfs("16m", path=path), \
            Exporter("--mode=node", "--no-collector.gpu", "--no-collector.cgroup", "--no-collector.sysv",
                     "--poll-interval=200ms", "--metric-opt-in-list=shmwatch_.*") as exporter:
        exporter.wait_for(lambda s: value(s, "shmwatch_inotify_active", pod_uid=uid) == 1, timeout=5)
        time.sleep(1)  # discovery publishes the unchanged set a few times
        with mounted_tmpfs("32m", path=path):  # stacked: same path, new device
            exporter.wait_for(lambda s: value(s, "shmwatch_mount_size_bytes", pod_uid=uid) == 32 << 20, timeout=5)
            time.sleep(0.5)
            fallocate(os.path.join(path, "nccl-on-top"), 1 << 20)
            exporter.wait_for(lambda s: (value(s, "shmwatch_segment_events_total", pod_uid=uid, event="created",
                                               **{"class": "nccl"}) or 0) >= 1, timeout=5)


SAME_SET_SCENARIO = """
import os, subprocess, sys, uuid
from exporter.collectors.discovery import MountDiscovery
from exporter.host.paths import Paths

root = sys.argv[1]
path = f"{root}/var/lib/kubelet/pods/{uuid.uuid4()}/volumes/kubernetes.io~empty-dir/dshm"
other = f"{root}/other"
os.makedirs(path), os.makedirs(other)
mount = lambda at: subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", at], check=True)
static = f"{root}/static"
os.makedirs(static)
mount(path), mount(static)
discovery = MountDiscovery(Paths(), [static], node_mode=True)
first = discovery.collect()
assert path in first.mounts() and static in first.mounts(), first
mount(other)
assert discovery.collect() is first, "a mount no target is on made a new set"
mount(path)
on_top = discovery.collect()
assert on_top is not first and on_top.mounts() == first.mounts(), "a mount on top is the same set"
mount(static)  # over a configured (static) target
assert discovery.collect() is not on_top, "a mount over a static target is the same set"
last = discovery.collect()
mount(os.path.dirname(os.path.dirname(path)))  # over the pod's volumes directory
assert discovery.collect() is not last, "a mount above a target is the same set"
print("ok")
"""


@needs_root
def test_discovery_makes_a_new_set_only_when_its_mounts_changed(tmp_path):
    """The watcher re-checks every mount for a new set: one comes when a target came, went or
    was mounted over (a found or a static target, or a directory above one), not when any
    other mount changed the table (a node's change often).
    As pid 1 of namespaces of its own: discovery reads pid 1's mountinfo."""
    in_own_mount_namespace(SAME_SET_SCENARIO, str(tmp_path), pid=True)
