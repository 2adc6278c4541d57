"""collectors/discovery.py on mountinfo fixture files: node mode finds the pods' emptyDir and
the runtimes' shm tmpfs mounts and the host's /dev/shm, labelled; something mounted over a
target drops it; the set is the same object while the mounts at or above the targets are
the same (the watcher then looks at nothing again), another one when a mount lands on top;
an empty table fails the run and the last set stands. A sidecar publishes its --shm.mount."""

import shutil
import uuid
from pathlib import Path
from typing import List, Tuple

import pytest

from exporter.collectors.discovery import MountDiscovery, discover
from exporter.host.mountinfo import parse_mountinfo
from exporter.host.paths import Paths
from exporter.model.types import MountSet
from tests.helpers import pod_mount

POD = "0a1b2c3d-1111-2222-3333-444455556666"
EMPTYDIR = f"/var/lib/kubelet/pods/{POD}/volumes/kubernetes.io~empty-dir/dshm"
SANDBOX = "0123456789abcdef0123"
CONTAINERD = f"/run/containerd/io.containerd.grpc.v1.cri/sandboxes/{SANDBOX}/shm"


def line(mount_id: int, point: str, fstype: str = "tmpfs", device: str = "0:50") -> str:
    return f"{mount_id} 1 {device} / {point} rw,nosuid - {fstype} {fstype} rw\n"


HOST = [
    line(20, "/", "ext4", "8:1"),
    line(21, "/dev/shm"),
    line(22, "/var/lib/kubelet", "ext4", "8:1"),
    line(23, EMPTYDIR, device="0:51"),
    line(24, CONTAINERD, device="0:52"),
    line(25, "/run/user/0"),  # a tmpfs of no pod: not watched
    line(26, f"/var/lib/kubelet/pods/{POD}/volumes/kubernetes.io~empty-dir/data", "ext4", "8:1"),
]


class Host:
    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "proc"
        for pid in ("1", "self"):
            (self.root / pid).mkdir(parents=True)
        self.write(HOST)

    def write(self, lines: List[str], pid: str = "1") -> None:
        (self.root / pid / "mountinfo").write_text("".join(lines))

    def discovery(self, static: Tuple[str, ...] = (), node: bool = True) -> MountDiscovery:
        return MountDiscovery(Paths(procfs=str(self.root)), list(static), node_mode=node)


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def targets(found: MountSet) -> List[Tuple[str, dict]]:
    return [(t.mount, t.labels) for t in found.targets]


def test_node_mode_finds_the_pods_and_runtimes_shm_and_the_hosts(host: Host) -> None:
    found = host.discovery().collect()
    assert targets(found) == [
        ("/dev/shm", {"pod_uid": "", "volume": "", "container_id": ""}),
        (CONTAINERD, {"pod_uid": "", "volume": "", "container_id": SANDBOX}),
        (EMPTYDIR, {"pod_uid": POD, "volume": "dshm", "container_id": ""}),
    ]


def test_the_set_is_the_same_object_until_a_mount_at_or_above_a_target_changes(host: Host) -> None:
    discovery = host.discovery()
    first = discovery.collect()
    host.write(HOST + [line(30, "/mnt/elsewhere", "ext4", "8:2")])  # not above any target
    assert discovery.collect() is first and discovery.current() is first
    host.write(HOST + [line(31, "/var/lib/kubelet/pods", "tmpfs", "0:60")])  # over a parent
    moved = discovery.collect()
    assert moved is not first and targets(moved) == targets(first)


def test_a_target_something_else_was_mounted_over_is_dropped(host: Host) -> None:
    discovery = host.discovery()
    host.write(HOST + [line(40, EMPTYDIR, "overlay", "0:70")])
    assert EMPTYDIR not in discovery.collect().mounts()
    host.write(HOST + [line(40, EMPTYDIR, "overlay", "0:70"), line(41, EMPTYDIR, device="0:71")])
    assert EMPTYDIR in discovery.collect().mounts()  # a tmpfs on top again: the last wins


def test_an_empty_table_fails_the_run_and_the_last_set_stands(host: Host) -> None:
    discovery = host.discovery()
    first = discovery.collect()
    host.write([])
    with pytest.raises(ValueError, match="mountinfo is empty"):
        discovery.collect()
    assert discovery.current() is first


def test_node_mode_keeps_the_configured_mounts_after_the_found_ones(host: Host) -> None:
    found = host.discovery(static=("/extra", "/dev/shm")).collect()
    assert found.mounts() == ["/dev/shm", CONTAINERD, EMPTYDIR, "/extra"]
    assert found.targets[-1].labels == {"pod_uid": "", "volume": "", "container_id": ""}


def test_a_sidecar_publishes_its_mounts_and_a_new_set_when_its_table_changed(host: Host) -> None:
    host.write([line(1, "/", "ext4", "8:1"), line(2, "/dev/shm")], pid="self")
    discovery = host.discovery(static=("/dev/shm",), node=False)
    assert not discovery.reports_status  # nothing to fail: no status series
    first = discovery.collect()
    assert targets(first) == [("/dev/shm", {})]
    host.write([line(1, "/", "ext4", "8:1"), line(2, "/dev/shm"), line(3, "/dev/shm")], pid="self")
    again = discovery.collect()
    assert again is not first and targets(again) == targets(first)  # a mount on top: another


def test_discover_keeps_the_topmost_entry_of_a_mount_point() -> None:
    entries = parse_mountinfo(line(1, "/dev/shm") + line(2, "/dev/shm", "ext4", "8:1"))
    assert discover(entries) == []
    entries = parse_mountinfo(line(1, "/dev/shm", "ext4", "8:1") + line(2, "/dev/shm"))
    assert [t.mount for t in discover(entries)] == ["/dev/shm"]


def test_unreadable_mountinfo_keeps_the_last_mount_set(tmp_path):
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    uid = str(uuid.uuid4())
    point = pod_mount("", uid)
    (proc / "1" / "mountinfo").write_text(f"99 1 0:50 / {point} rw,nosuid - tmpfs tmpfs rw,size=16384k\n")
    from exporter.runtime.scheduler import Sampler

    discovery = MountDiscovery(Paths(procfs=str(proc)), ["/dev/shm"], node_mode=True)
    sampler = Sampler([discovery])
    published = []
    sampler.subscribe(published.append)
    sampler.runners["discovery"].run_once(full=True)
    assert point in published[0].result.mounts()
    shutil.rmtree(proc / "1")
    sampler.runners["discovery"].run_once(full=True)
    # An unreadable mountinfo fails the discovery run, and publishes no set.
    assert published[-1].result is None and "mountinfo" in published[-1].error
    assert point in discovery.current().mounts()  # the last good set stands
    assert point in sampler.inputs.mounts  # and every run is handed it
