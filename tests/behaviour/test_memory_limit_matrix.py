"""Which memory limit binds a workload, across the conditions that change it: cgroup v1 and v2,
a limit on the cgroup itself, a tighter one above it (its pod, a QoS slice), a looser one above
it, none anywhere, a cgroup that cannot be read; --memory.limit-bytes tighter, looser, at and
above MemTotal. In each cell, the decisions users act on: the limit and its `limit_from`, the
OOM risk and projection ratios, and `shmwatch_mount_effective_size_bytes`; with no limit they
are absent (the effective size is then the tmpfs's own), never a confident 0 or a fake limit.

The cells run the exporter's own wiring (App: the flag checked against MemTotal, handed to the
cgroup collector and the model) once over fixture cgroup trees written as each kernel writes
them, with a real tmpfs for the mount; the v1 cells run again on real memory cgroups of this
machine, whose kernel computes hierarchical_memory_limit and charges a real fill."""

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import pytest
from prometheus_client.registry import CollectorRegistry

from exporter.app import App
from exporter.config import parse_args
from tests.conftest import IS_ROOT, fallocate, mounted_tmpfs, prerequisite_missing, remove_cgroup
from tests.helpers import run_every_source_once

MiB, GiB = 1 << 20, 1 << 30
V1_MAX = 9223372036854771712  # what v1 reads back for "no limit" (PAGE_COUNTER_MAX pages)
MEM_TOTAL = 8 * GiB  # the fixture host's MemTotal
SHM_SIZE, SHM_USED = GiB, 64 * MiB  # the real tmpfs, and what is written to it
# The fixtures' container: its usage, and inactive file cache (not in the working set).
USAGE, INACTIVE_FILE = 160 * MiB, 16 * MiB
UID = "5e6f7a8b-9c0d-4e1f-8a2b-3c4d5e6f7a8b"
CONTAINER = "c0ffee" + "ab" * 29


@dataclass(frozen=True)
class Layout:
    """Where a kubelet puts a pod's cgroups: each level's path as /proc/<pid>/cgroup names it."""

    version: int
    hierarchy: str  # below /sys/fs/cgroup: v1's memory controller, v2's unified root
    levels: Dict[str, str]  # "top", "qos", "pod", "container" -> path, outermost first


def cgroupfs_driver(prefix: str = "") -> Layout:
    qos = f"{prefix}/kubepods/burstable"
    pod = f"{qos}/pod{UID}"
    return Layout(1, "memory", {"top": f"{prefix}/kubepods", "qos": qos, "pod": pod, "container": f"{pod}/{CONTAINER}"})


def systemd_driver() -> Layout:
    qos = "/kubepods.slice/kubepods-burstable.slice"
    pod = f"{qos}/kubepods-burstable-pod{UID.replace('-', '_')}.slice"
    levels = {"top": "/kubepods.slice", "qos": qos, "pod": pod, "container": f"{pod}/cri-containerd-{CONTAINER}.scope"}
    return Layout(2, "", levels)


# Where the limits are (MiB; a level not named has none) -> the limit that binds and its label.
Placement = Tuple[Dict[str, int], Optional[Tuple[int, str]]]
PLACEMENTS: Dict[str, Placement] = {
    "on the cgroup itself": ({"container": 512}, (512 * MiB, "self")),
    "tighter on its pod": ({"container": 1024, "pod": 256}, (256 * MiB, "pod")),
    "on its pod alone (KEP-2837)": ({"pod": 256}, (256 * MiB, "pod")),
    "tighter on the QoS slice": ({"container": 1024, "qos": 384}, (384 * MiB, "ancestor")),
    "looser above it": ({"container": 512, "pod": 2048, "qos": 3072}, (512 * MiB, "self")),
    "as tight on its pod (the outermost named)": ({"container": 256, "pod": 256}, (256 * MiB, "pod")),
    "none anywhere": ({}, None),
}
FLAGS: Dict[str, Optional[int]] = {
    "no flag": None,
    "flag tighter": 200 * MiB,
    "flag as tight as the pod's": 256 * MiB,
    "flag looser": 3 * GiB,
    "flag at MemTotal": MEM_TOTAL,
    "flag above MemTotal": 2 * MEM_TOTAL,
}


def binding(placed: Optional[Tuple[int, str]], flag: Optional[int]) -> Optional[Tuple[int, str]]:
    """README "Which memory limit": the flag counts where tighter than the cgroup's limit (or
    where the cgroup has none), and is no limit at all from MemTotal up."""
    if flag is None or flag >= MEM_TOTAL:
        return placed
    return (flag, "flag") if placed is None or flag < placed[0] else placed


# --- fixture trees, as each kernel writes them -------------------------------------------------
def write_files(directory: str, files: Dict[str, str]) -> None:
    os.makedirs(directory, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text + "\n")


def v1_files(limit: Optional[int], tightest_up: Optional[int], usage: int) -> Dict[str, str]:
    stat = f"total_inactive_file {INACTIVE_FILE}\ntotal_shmem {SHM_USED}\nhierarchical_memory_limit {tightest_up or V1_MAX}"
    return {
        "memory.limit_in_bytes": str(limit or V1_MAX),
        "memory.usage_in_bytes": str(usage),
        "memory.stat": stat,
        "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0",
        "memory.failcnt": "0",
    }


def v2_files(limit: Optional[int], usage: int) -> Dict[str, str]:
    return {
        "memory.max": str(limit) if limit else "max",
        "memory.current": str(usage),
        "memory.stat": f"anon {usage - SHM_USED}\nshmem {SHM_USED}\ninactive_file {INACTIVE_FILE}",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0",
    }


def write_tree(sys_root: str, layout: Layout, limits_mib: Dict[str, int], usage: int) -> str:
    """The layout's cgroups with these limits -> the container's directory."""
    root = os.path.normpath(os.path.join(sys_root, "fs", "cgroup", layout.hierarchy))
    if layout.version == 1:  # v1's root has the files, unlimited; v2's root has no memory.max
        write_files(root, v1_files(None, None, usage))
    tightest: Optional[int] = None
    directory = root
    for level, path in layout.levels.items():
        limit = limits_mib[level] * MiB if level in limits_mib else None
        tightest = min(x for x in (tightest, limit) if x is not None) if limit or tightest else None
        directory = root + path
        write_files(directory, v1_files(limit, tightest, usage) if layout.version == 1 else v2_files(limit, usage))
    return directory


@pytest.fixture(scope="module")
def shm() -> Iterator[str]:
    """A real 1 GiB tmpfs holding 64 MiB."""
    if not IS_ROOT:
        prerequisite_missing("needs root to mount tmpfs")
    with mounted_tmpfs("1g") as path:
        fallocate(os.path.join(path, "psm_kv"), SHM_USED)
        yield path


def procfs(tmp: str) -> str:
    """A /proc with this host's MemTotal, and our own mount table (where the tmpfs is)."""
    proc = os.path.join(tmp, "proc")
    write_files(proc, {"meminfo": f"MemTotal: {MEM_TOTAL // 1024} kB\nMemAvailable: {MEM_TOTAL // 2048} kB"})
    os.makedirs(os.path.join(proc, "self"))
    shutil.copy("/proc/self/mountinfo", os.path.join(proc, "self", "mountinfo"))
    return proc


def scrape_once(shm: str, procfs: str, sysfs: str, cgroup_dir: str, flag: Optional[int]) -> CollectorRegistry:
    """The exporter's wiring, every source run once: what its first scrape shows."""
    argv = [f"--path.procfs={procfs}", f"--path.sysfs={sysfs}", f"--cgroup.path={cgroup_dir}", f"--shm.mount={shm}"]
    argv += ["--no-collector.gpu", "--no-collector.segments", "--no-collector.sysv"]
    argv += ["--metric-opt-in-list=.*"]  # the ratios the recording rules make from it too (opt-in)
    argv += [f"--memory.limit-bytes={flag}"] if flag is not None else []
    app = App(parse_args(argv))
    try:
        run_every_source_once(app.sampler)
        return app.registry
    finally:
        app.stop(wait=0)


def samples(registry: CollectorRegistry, name: str) -> List[Tuple[Dict[str, str], float]]:
    return [(s.labels, s.value) for family in registry.collect() for s in family.samples if s.name == name]


def assert_limit_decisions(
    registry: CollectorRegistry, cgroup: str, shm: str, bound: Optional[Tuple[int, str]]
) -> None:
    """The limit, where it binds, and what each ratio and the effective size make of it."""
    got = registry.get_sample_value
    working_set = got("shmwatch_cgroup_memory_working_set_bytes", {"cgroup": cgroup})
    size, used = got("shmwatch_mount_size_bytes", {"mount": shm}), got("shmwatch_mount_used_bytes", {"mount": shm})
    assert working_set is not None and size == SHM_SIZE and used is not None and used >= SHM_USED
    limits = samples(registry, "shmwatch_cgroup_memory_limit_bytes")
    risks, projections = (samples(registry, f"shmwatch_{n}_ratio") for n in ("oom_risk", "shm_oom_projection"))
    effective = got("shmwatch_mount_effective_size_bytes", {"mount": shm})
    if bound is None:  # no limit anywhere: none invented, and the tmpfs alone bounds the mount
        assert (limits, risks, projections, effective) == ([], [], [], SHM_SIZE)
        return
    limit, source = bound
    assert limits == [({"cgroup": cgroup, "limit_from": source}, limit)]
    outside_shm = max(0, working_set - used)  # shm is part of the working set: counted once
    assert [labels for labels, _ in risks] == [{"cgroup": cgroup}]
    assert [ratio for _, ratio in risks] == pytest.approx([working_set / limit])
    assert [labels for labels, _ in projections] == [{"mount": shm, "cgroup": cgroup}]
    assert [ratio for _, ratio in projections] == pytest.approx([(outside_shm + size) / limit])
    assert effective == min(size, max(0, limit - outside_shm))


def cells() -> Iterator[object]:
    for layout in (cgroupfs_driver(), systemd_driver()):
        for placement, (limits, placed) in PLACEMENTS.items():
            for flag_name, flag in FLAGS.items():
                ids = f"v{layout.version}-{placement}-{flag_name}"
                yield pytest.param(layout, limits, binding(placed, flag), flag, id=ids)


@pytest.mark.parametrize("layout, limits_mib, bound, flag", cells())
def test_the_limit_that_binds_and_what_it_decides(
    layout: Layout,
    limits_mib: Dict[str, int],
    bound: Optional[Tuple[int, str]],
    flag: Optional[int],
    shm: str,
    tmp_path: str,
) -> None:
    sysfs = os.path.join(tmp_path, "sys")
    container = write_tree(sysfs, layout, limits_mib, USAGE)
    registry = scrape_once(shm, procfs(str(tmp_path)), sysfs, container, flag)
    assert_limit_decisions(registry, layout.levels["container"], shm, bound)


@pytest.mark.parametrize("flag_name, flag", FLAGS.items())
def test_a_cgroup_that_cannot_be_read_knows_no_limit_but_the_flag(
    flag_name: str, flag: Optional[int], shm: str, tmp_path: str
) -> None:
    """The workload's cgroup unreadable (a sidecar without the host's cgroupfs): the effective
    size is the Downward API's limit where usable, else absent: the limit is unknown, not none."""
    sysfs = os.path.join(tmp_path, "sys")
    os.makedirs(os.path.join(sysfs, "fs", "cgroup"))
    registry = scrape_once(shm, procfs(str(tmp_path)), sysfs, os.path.join(sysfs, "fs", "cgroup", "gone"), flag)
    assert registry.get_sample_value("shmwatch_collector_success", {"collector": "cgroup"}) == 0
    assert registry.get_sample_value("shmwatch_mount_size_bytes", {"mount": shm}) == SHM_SIZE
    for name in ("cgroup_memory_limit_bytes", "oom_risk_ratio", "shm_oom_projection_ratio"):
        assert samples(registry, f"shmwatch_{name}") == []
    effective = registry.get_sample_value("shmwatch_mount_effective_size_bytes", {"mount": shm})
    usable = flag is not None and flag < MEM_TOTAL
    assert effective == (min(SHM_SIZE, flag) if usable and flag is not None else None)


@pytest.mark.parametrize(
    "own, above, bound",
    [
        (None, 256, (256 * MiB, "ancestor")),
        (512, 256, (256 * MiB, "ancestor")),
        (128, 256, (128 * MiB, "self")),
        (None, None, None),
    ],
)
def test_v1_a_limit_above_what_is_mounted_binds_through_memory_stat(
    own: Optional[int], above: Optional[int], bound: Optional[Tuple[int, str]], shm: str, tmp_path: str
) -> None:
    """Docker on v1 mounts a container's own memory cgroup as the hierarchy's root: a limit
    above it (its pod's, the daemon's) is seen only in hierarchical_memory_limit."""
    root = os.path.join(tmp_path, "sys", "fs", "cgroup", "memory")
    tightest = min(x for x in (own, above) if x is not None) * MiB if own or above else None
    write_files(root, v1_files(own and own * MiB, tightest, USAGE))
    registry = scrape_once(shm, procfs(str(tmp_path)), os.path.join(tmp_path, "sys"), root, None)
    assert_limit_decisions(registry, "/", shm, bound)


OTHER_UID = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"


def emptydir(tmp: str, uid: str) -> str:
    return f"{tmp}/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm"


@pytest.mark.parametrize("flag", [None, 200 * MiB])
def test_node_mode_takes_each_pods_own_limit_and_never_the_flag(flag: Optional[int], tmp_path: str) -> None:
    """Two pods' emptyDirs, real tmpfs mounts found by node mode's discovery: one pod's cgroup
    with a 256 MiB limit, the other's not on this host's cgroupfs. --memory.limit-bytes is one
    workload's limit: it binds neither. The pod whose cgroup is not read has a limit, unknown:
    no effective size, rather than its whole tmpfs."""
    tmp, layout = str(tmp_path), systemd_driver()
    sysfs = os.path.join(tmp, "sys")
    write_tree(sysfs, layout, {"pod": 256}, USAGE)
    read, unread = emptydir(tmp, UID), emptydir(tmp, OTHER_UID)
    with mounted_tmpfs("1g", path=read), mounted_tmpfs("1g", path=unread):
        proc = procfs(tmp)
        os.makedirs(os.path.join(proc, "1"))
        shutil.copy("/proc/1/mountinfo", os.path.join(proc, "1", "mountinfo"))  # the host's mounts
        argv = [f"--path.procfs={proc}", f"--path.sysfs={sysfs}", "--mode=node", "--no-collector.gpu"]
        argv += ["--no-collector.segments", "--no-collector.sysv", "--no-collector.oom"]
        app = App(parse_args(argv + ([f"--memory.limit-bytes={flag}"] if flag else [])))
        try:
            run_every_source_once(app.sampler)  # discovery first: the others read its mounts
            registry = app.registry
        finally:
            app.stop(wait=0)
    pod = layout.levels["pod"]
    assert pod.endswith(".slice")
    limits = samples(registry, "shmwatch_cgroup_memory_limit_bytes")
    assert limits == [({"limit_from": "pod", "pod_uid": UID}, 256 * MiB)]  # a pod's cgroup: by its pod

    def by_mount(name: str) -> Dict[str, float]:
        """A pod's mount by its pod_uid (its only label besides volume), another by its path."""
        return {labels.get("pod_uid") or labels["mount"]: v for labels, v in samples(registry, name)}

    effective = by_mount("shmwatch_mount_effective_size_bytes")
    assert effective[UID] == 256 * MiB - (USAGE - INACTIVE_FILE)  # what the limit leaves (the tmpfs is empty)
    assert OTHER_UID not in effective
    host_shm = by_mount("shmwatch_mount_size_bytes")["/dev/shm"]
    assert effective["/dev/shm"] == host_shm  # the node's own /dev/shm: no pod's, not the flag's
    assert list(by_mount("shmwatch_shm_oom_projection_ratio")) == [UID]


# --- real v1 memory cgroups -------------------------------------------------------------------
V1_ROOT = "/sys/fs/cgroup/memory"
FILL = 'echo $$ > "$0/cgroup.procs" && exec head -c "$1" /dev/zero > "$2"'


@pytest.fixture
def real_v1_tree() -> Iterator[Layout]:
    """The cgroupfs driver's layout under a top cgroup of this test's own (others' tests make
    /kubepods and remove it when done)."""
    if not os.path.exists(os.path.join(V1_ROOT, "memory.usage_in_bytes")):
        prerequisite_missing(f"no cgroup v1 memory controller at {V1_ROOT}")
    layout = cgroupfs_driver(prefix=f"/shmwatch-test-{uuid.uuid4().hex[:8]}")
    made = [V1_ROOT + os.path.dirname(layout.levels["top"]), *(V1_ROOT + p for p in layout.levels.values())]
    for directory in made:
        os.mkdir(directory)
    try:
        yield layout
    finally:
        for directory in reversed(made):
            remove_cgroup(directory)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("flag_name", ["no flag", "flag tighter"])
def test_real_v1_cgroups_bind_as_the_fixtures_do(
    placement: str, flag_name: str, real_v1_tree: Layout, tmp_path: str
) -> None:
    """The same placements in real memory cgroups, 64 MiB of tmpfs written from the container's:
    the kernel's own files (its "no limit", hierarchical_memory_limit, a real charge)."""
    limits_mib, placed = PLACEMENTS[placement]
    for level, path in real_v1_tree.levels.items():
        if level in limits_mib:
            with open(f"{V1_ROOT}{path}/memory.limit_in_bytes", "w") as f:
                f.write(str(limits_mib[level] * MiB))
    container = V1_ROOT + real_v1_tree.levels["container"]
    with mounted_tmpfs("1g") as shm:
        segment = os.path.join(shm, "psm_kv")
        subprocess.run(["sh", "-c", FILL, container, str(SHM_USED), segment], check=True)
        try:
            registry = scrape_once(shm, procfs(str(tmp_path)), "/sys", container, FLAGS[flag_name])
            shmem = registry.get_sample_value(
                "shmwatch_cgroup_memory_shmem_bytes", {"cgroup": real_v1_tree.levels["container"]}
            )
            assert shmem is not None and shmem >= SHM_USED  # charged to the container's cgroup
            assert_limit_decisions(registry, real_v1_tree.levels["container"], shm, binding(placed, FLAGS[flag_name]))
        finally:
            os.unlink(segment)
