"""collectors/shm_mount.py on real mounts: a tmpfs's statvfs and mountinfo facts, a path
that is no mount point (or no longer one) not measured, a filesystem other than tmpfs
reported with a warning, a statvfs error kept as the mount's error, each condition warned
once while it lasts; quick runs measure only the mounts inotify named and hand the others
back as they were; a measure whose figures did not move is the same object."""

import errno
import logging
import os
import subprocess
import tempfile
from typing import Iterator, List

import pytest

from exporter.collectors.shm_mount import ShmMountCollector
from exporter.host.paths import Paths
from exporter.model.types import MountUsage
from tests.conftest import fallocate, mounted_tmpfs, needs_root
from tests.helpers import Runs

pytestmark = needs_root
MIB = 1 << 20


def runs(*mounts: str, **options: object) -> Runs:
    return Runs(ShmMountCollector(Paths(), **options), list(mounts))  # type: ignore[arg-type]


def mountinfo_of(path: str) -> List[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [line.split() for line in f if line.split()[4] == path][-1]


def warned(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def test_a_tmpfs_is_measured_with_its_mount_facts(tmpfs: str) -> None:
    collector = runs(tmpfs)
    [empty] = collector.full()
    assert (empty.mount, empty.fstype, empty.is_mount_point, empty.error) == (tmpfs, "tmpfs", True, None)
    assert empty.size_bytes == 16 * MIB and empty.used_bytes == 0
    assert empty.available_bytes == 16 * MIB and empty.inodes > 0 and empty.inodes_free <= empty.inodes
    fields = mountinfo_of(tmpfs)
    assert empty.instance is not None
    assert (empty.instance.mount_id, empty.instance.device) == (int(fields[0]), fields[2])
    fallocate(os.path.join(tmpfs, "psm_a"), 3 * MIB)
    [used] = collector.full()
    assert used.used_bytes == 3 * MIB and used.usage_ratio == pytest.approx(3 / 16)
    assert used.instance == empty.instance


def test_a_measure_whose_figures_did_not_move_is_the_same_object(tmpfs: str) -> None:
    """A render's memo and the model step compare it by identity."""
    collector = runs(tmpfs)
    [first] = collector.full()
    [second] = collector.full()
    assert second is first
    fallocate(os.path.join(tmpfs, "x"), MIB)
    [third] = collector.full()
    assert third is not first and third.used_bytes == MIB


def test_quick_runs_measure_only_the_mounts_inotify_named(tmpfs: str) -> None:
    with mounted_tmpfs("8m") as other:
        collector = runs(tmpfs, other)
        [a, b] = collector.quick()  # before any poll: a full run
        assert (a.mount, b.mount) == (tmpfs, other)
        fallocate(os.path.join(tmpfs, "x"), MIB)
        fallocate(os.path.join(other, "y"), MIB)
        collector.changed(other, "y")
        [a2, b2] = collector.quick()
        assert a2 is a and a2.used_bytes == 0  # not named: as last measured
        assert b2.used_bytes == MIB
        [a3, b3] = collector.full()
        assert a3.used_bytes == MIB and b3.used_bytes == MIB


def test_a_directory_that_is_no_mount_point_is_not_measured_and_warned_once(
    tmp_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its statvfs would be the disk's beneath: never reported as the mount's."""
    caplog.set_level(logging.INFO, logger="exporter.collectors.shm_mount")
    collector = runs(str(tmp_path))
    for _ in range(3):
        [usage] = collector.full()
        assert usage == MountUsage(mount=str(tmp_path), fstype="unknown", source="", is_mount_point=False,
                                   error="not a mount point")
    assert warned(caplog, "is not a mount point (unmounted?): not measured") == 1


def test_a_mount_unmounted_between_polls_is_no_longer_measured() -> None:
    path = tempfile.mkdtemp(prefix="shmwatch-unmounted-")
    try:
        with mounted_tmpfs("8m", path=path):
            collector = runs(path)
            [mounted] = collector.full()
            assert mounted.error is None and mounted.size_bytes == 8 * MIB
        [gone] = collector.full()
        assert (gone.error, gone.is_mount_point, gone.size_bytes) == ("not a mount point", False, 0)
    finally:
        os.rmdir(path)


@pytest.fixture
def ramfs() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="shmwatch-ramfs-")
    subprocess.run(["mount", "-t", "ramfs", "ramfs", path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


def test_a_mount_that_is_not_tmpfs_is_reported_with_a_warning_once(
    ramfs: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.collectors.shm_mount")
    collector = runs(ramfs)
    collector.full()
    [usage] = collector.full()
    assert (usage.fstype, usage.is_mount_point, usage.error) == ("ramfs", True, None)
    assert warned(caplog, "is ramfs, not tmpfs; reporting the filesystem that holds it") == 1


def test_a_statvfs_error_is_the_mounts_error_and_warned_again_after_it_ended(
    tmpfs: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Still this mount (its instance stands, so its peaks do); warned once while it lasts."""
    caplog.set_level(logging.INFO, logger="exporter.collectors.shm_mount")
    failing = {"now": True}

    def statvfs(path: str) -> os.statvfs_result:
        if failing["now"]:
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return os.statvfs(path)

    collector = runs(tmpfs, statvfs=statvfs)
    collector.full()
    [usage] = collector.full()
    assert usage.error == "Input/output error" and usage.instance is not None and usage.fstype == "tmpfs"
    assert warned(caplog, "cannot be measured: Input/output error") == 1
    failing["now"] = False
    [healthy] = collector.full()
    assert healthy.error is None and healthy.size_bytes == 16 * MIB
    failing["now"] = True
    collector.full()
    assert warned(caplog, "cannot be measured: Input/output error") == 2


def test_a_mount_no_longer_handed_is_forgotten_and_warned_afresh_when_back(
    tmp_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Node mode: a deleted pod's warnings go with it; a pod at the same path is told about."""
    caplog.set_level(logging.INFO, logger="exporter.collectors.shm_mount")
    collector = runs(str(tmp_path))
    collector.full()
    collector.mounts = []
    assert collector.full() == []
    collector.mounts = [str(tmp_path)]
    collector.full()
    assert warned(caplog, "is not a mount point (unmounted?)") == 2


def test_effective_size_is_absent_while_the_memory_limit_is_unknown(tmp_path):
    """The cgroup collector on but failing, and no --memory.limit-bytes: the tmpfs size alone
    would overstate what can be filled, so no effective size is exported."""
    from exporter.collectors.cgroup import CgroupCollector
    from exporter.collectors.shm_mount import ShmMountCollector
    from tests.helpers import registry_for

    shm = "/dev/shm"  # a mount point (only read): a directory that is none is not measured
    broken = CgroupCollector(Paths(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys")))
    reg, _ = registry_for(ShmMountCollector(Paths()), broken, mounts=[str(shm)])
    assert reg.get_sample_value("shmwatch_collector_success", {"collector": "cgroup"}) == 0
    assert reg.get_sample_value("shmwatch_mount_size_bytes", {"mount": str(shm)}) > 0
    assert reg.get_sample_value("shmwatch_mount_effective_size_bytes", {"mount": str(shm)}) is None
    reg, _ = registry_for(ShmMountCollector(Paths()), broken, memory_limit=1 << 20, mounts=[str(shm)])
    assert reg.get_sample_value("shmwatch_mount_effective_size_bytes", {"mount": str(shm)}) == 1 << 20


def test_the_model_is_rebuilt_only_when_its_version_moved(tmp_path):
    """The version moves with every accepted observation and every change to the state store
    (nobody is called back); current() builds the model again only then."""
    from exporter.collectors.shm_mount import ShmMountCollector
    from tests.helpers import registry_for

    shm = tmp_path / "shm"
    shm.mkdir()
    _, harness = registry_for(ShmMountCollector(Paths()), mounts=[str(shm)])
    step = harness.step
    model, version = step.current(), step.version()
    assert step.current() is model and step.version() == version  # nothing happened
    harness.sampler.runners["shm_mount"].run_once(full=False)
    assert step.version() != version
    rebuilt = step.current()
    assert rebuilt is not model and step.current() is rebuilt
    version = step.version()
    harness.state.count_event(str(shm), "nccl", "created")  # the watcher, say
    assert step.version() != version
    assert step.current().states.event_rows == {str(shm): (("nccl", "created", 1),)}
