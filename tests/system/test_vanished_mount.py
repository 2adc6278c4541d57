"""A mount that is gone is gone: after `umount` the path's directory on the disk beneath is
neither measured nor walked, and no file of that disk is reported; a new tmpfs mounted there
starts its peaks and high-water mark afresh, also for `check --recommend --exporter.url`."""
import json
import os
import subprocess
import sys

from tests.conftest import EVERY_FAMILY, REPO, Exporter, fallocate, needs_root, prerequisite_missing, select, value
from exporter.host.paths import Paths
from tests.helpers import Runs

MiB = 1 << 20


@needs_root
def test_an_unmounted_path_is_an_error_and_a_new_mount_there_starts_afresh(tmp_path):
    path = str(tmp_path / "shm")
    os.makedirs(path)
    # A file of the root disk deleted but held open by this (readable) process: what the
    # owner scan would report as a hidden segment if it took the disk for the mount.
    secret = str(tmp_path / "rootdisk-secret")
    leak = os.open(secret, os.O_CREAT | os.O_RDWR, 0o600)
    os.write(leak, b"\1" * 65536)
    os.unlink(secret)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", path], check=True)
    try:
        with Exporter(f"--shm.mount={path}", "--no-collector.gpu", "--poll-interval=200ms",
                      "--inventory-interval=1s", EVERY_FAMILY) as exporter:
            fallocate(os.path.join(path, "psm_big"), 48 * MiB)
            exporter.wait_for(lambda s: (value(s, "shmwatch_mount_max_used_bytes", mount=path) or 0) >= 48 * MiB)
            subprocess.run(["umount", path], check=True)  # the directory stays, on the disk
            s = exporter.wait_for(lambda s: value(s, "shmwatch_mount_error", mount=path) == 1
                                  and not select(s, "shmwatch_segments", mount=path), timeout=10)
            for name in ("size", "used", "peak_used", "max_used"):
                assert value(s, f"shmwatch_mount_{name}_bytes", mount=path) is None, name
            [(info, _)] = select(s, "shmwatch_mount_info", mount=path)
            assert info["fstype"] == "unknown" and "source" not in info, info  # no empty label
            assert not select(s, "shmwatch_top_segment_bytes", mount=path)
            assert not [ls for ls, _ in select(s, "shmwatch_top_segment_bytes") if "rootdisk" in ls["name"]]
            assert value(s, "shmwatch_collector_success", collector="segments") == 1
            assert "not a mount point" in exporter.log()

            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", path], check=True)
            s = exporter.wait_for(lambda s: value(s, "shmwatch_mount_size_bytes", mount=path) == 16 * MiB
                                  and value(s, "shmwatch_segments", mount=path, state="linked") is None
                                  and select(s, "shmwatch_segments", mount=path) is not None, timeout=10)
            assert value(s, "shmwatch_mount_error", mount=path) is None  # measured again: no error series
            assert value(s, "shmwatch_mount_max_used_bytes", mount=path) < MiB
            assert value(s, "shmwatch_mount_peak_used_bytes", mount=path) < MiB
            result = subprocess.run([sys.executable, "-m", "exporter", "check", "--no-collector.gpu", "--recommend",
                                     "--output", "json", f"--shm.mount={path}", f"--exporter.url={exporter.url}"],
                                    cwd=REPO, capture_output=True, text=True, timeout=60)
            [rec] = json.loads(result.stdout)["recommendations"]
            assert rec["source"] == "exporter" and rec["observed_peak_bytes"] < MiB, rec
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        os.close(leak)


@needs_root
def test_a_remount_between_two_polls_is_a_new_mount_too(tmp_path):
    """umount and mount at once, no poll between: the kernel hands the new tmpfs the old one's
    device number and mountinfo ID; statx's unique mount ID (Linux 6.8) tells them apart."""
    from exporter.host.libc import unique_mount_id
    path = str(tmp_path / "shm")
    os.makedirs(path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", path], check=True)
    if unique_mount_id(path) is None:
        subprocess.run(["umount", "-l", path], check=False)
        prerequisite_missing("statx STATX_MNT_ID_UNIQUE needs Linux 6.8")
    try:
        with Exporter(f"--shm.mount={path}", "--no-collector.gpu", "--no-collector.segments",
                      "--poll-interval=1s") as exporter:
            fallocate(os.path.join(path, "psm_big"), 48 * MiB)
            exporter.wait_for(lambda s: (value(s, "shmwatch_mount_max_used_bytes", mount=path) or 0) >= 48 * MiB)
            subprocess.run(f"umount {path} && mount -t tmpfs -o size=16m tmpfs {path}", shell=True, check=True)
            s = exporter.wait_for(lambda s: value(s, "shmwatch_mount_size_bytes", mount=path) == 16 * MiB, timeout=10)
            assert value(s, "shmwatch_mount_max_used_bytes", mount=path) < MiB
    finally:
        subprocess.run(["umount", "-l", path], check=False)


@needs_root
def test_a_mounts_unique_id_is_asked_again_only_when_the_mount_table_changed(tmp_path, monkeypatch):
    """A poll with the mount table unchanged has the same mounts: no statx per mount; a remount
    changes the table, and the next poll asks again and sees the new mount."""
    from exporter.collectors import shm_mount
    from exporter.host.libc import unique_mount_id
    asked = []
    monkeypatch.setattr(shm_mount, "unique_mount_id", lambda p: asked.append(p) or unique_mount_id(p))
    path = str(tmp_path / "shm")
    os.makedirs(path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", path], check=True)
    try:
        collector = Runs(shm_mount.ShmMountCollector(Paths()), [path])
        first = collector.full()[0].instance
        assert collector.full()[0].instance == first and len(asked) == 1
        subprocess.run(f"umount {path} && mount -t tmpfs -o size=16m tmpfs {path}", shell=True, check=True)
        usage = collector.full()[0]
        assert len(asked) == 2 and usage.size_bytes == 16 * MiB
        if first.unique_id is not None:  # Linux 6.8: the new mount is told apart by its unique ID
            assert usage.instance != first
    finally:
        subprocess.run(["umount", "-l", path], check=False)
