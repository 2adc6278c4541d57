"""A real tmpfs, a real shmwatch process, a real scrape over HTTP, promtool on the text."""
import os

from tests.conftest import (EVERY_FAMILY, Exporter, fallocate, in_own_mount_namespace, mounted_tmpfs, needs_root, promtool_check_metrics,
                            value)

MiB = 1 << 20

PAGE = os.sysconf("SC_PAGE_SIZE")


@needs_root
def test_real_tmpfs_usage_matches_statvfs(tmpfs):
    fallocate(os.path.join(tmpfs, "psm_fill"), 12 << 20)
    st = os.statvfs(tmpfs)
    size, used = st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", EVERY_FAMILY) as exporter:
        text = exporter.scrape_text()
        samples = exporter.scrape()
    m = {"mount": tmpfs}
    assert value(samples, "shmwatch_mount_size_bytes", **m) == size == 16 << 20
    assert abs(value(samples, "shmwatch_mount_used_bytes", **m) - used) <= PAGE
    assert abs(value(samples, "shmwatch_mount_used_bytes", **m) - (12 << 20)) <= PAGE
    assert abs(value(samples, "shmwatch_mount_usage_ratio", **m) - 0.75) <= PAGE / size
    assert value(samples, "shmwatch_mount_info", mount=tmpfs, fstype="tmpfs") == 1
    assert value(samples, "shmwatch_build_info") == 1
    result = promtool_check_metrics(text)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr


@needs_root
def test_sigterm_exits_cleanly_and_quickly(tmpfs):
    import time
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu") as exporter:
        started = time.monotonic()
        code = exporter.stop()
        assert code == 0 and time.monotonic() - started < 2.0, exporter.log()


@needs_root
def test_a_quick_run_measures_only_the_mounts_inotify_saw_change():
    """200 pods, 10 events a second: statvfs of every mount per event cost 5 % of a core.
    The mount an event touched is measured again; the others keep the poll's figures until
    the next poll."""
    from exporter.collectors.shm_mount import ShmMountCollector
    from exporter.host.paths import Paths
    from tests.helpers import Runs
    with mounted_tmpfs("8m") as a, mounted_tmpfs("8m") as b:
        runs = Runs(ShmMountCollector(Paths()), [a, b])
        before = {u.mount: u.used_bytes for u in runs.full()}
        fallocate(os.path.join(a, "nccl-a"), MiB)
        fallocate(os.path.join(b, "nccl-b"), MiB)
        runs.changed(a, "nccl-a")  # what the watcher tells the scheduler
        quick = {u.mount: u.used_bytes for u in runs.quick()}
        assert quick[a] == before[a] + MiB
        assert quick[b] == before[b], "an untouched mount was measured again"
        polled = {u.mount: u.used_bytes for u in runs.full()}
        assert polled[b] == before[b] + MiB


@needs_root
def test_a_poll_keeps_an_unchanged_mounts_usage_and_measures_a_changed_one_again(tmpfs):
    """A mount whose statvfs and mount entry did not move has the same usage, also when other
    mounts came or went; a write shows at the next poll."""
    from exporter.collectors.shm_mount import ShmMountCollector
    from exporter.host.paths import Paths
    from tests.helpers import Runs
    runs = Runs(ShmMountCollector(Paths()), [tmpfs])
    [first] = runs.full()
    with mounted_tmpfs("1m"):  # the mount table changed (a pod came): this mount's entry did not
        [again] = runs.full()
    assert again == first
    fallocate(os.path.join(tmpfs, "psm_grow"), 4 << 20)
    [grown] = runs.full()
    assert grown.used_bytes - first.used_bytes >= 4 << 20
    assert grown.inodes_free == first.inodes_free - 1


SAME_USAGE_SCENARIO = """
import mmap, os, subprocess, sys
from exporter.collectors.shm_mount import ShmMountCollector
from exporter.host.paths import Paths
from tests.helpers import Runs

path = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", path], check=True)
collector = Runs(ShmMountCollector(Paths()), [path])
[first] = collector.full()
[again] = collector.full()
assert again is first, "an unchanged mount made anew"
fd = os.open(os.path.join(path, "psm_mapped"), os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 2 << 20)
with mmap.mmap(fd, 2 << 20) as m:  # pages touched through a mapping: no inotify event
    m[:] = b"x" * (2 << 20)
    [grown] = collector.full()
assert grown.used_bytes - first.used_bytes == 2 << 20, (first, grown)
assert (grown.instance, grown.fstype, grown.is_mount_point) == (first.instance, "tmpfs", True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", path], check=True)
[top] = collector.full()
assert top.size_bytes == 4 << 20 and top.instance != first.instance, (first, top)
print("ok")
"""


@needs_root
def test_a_poll_hands_back_an_unchanged_mounts_usage_and_sees_a_mapped_write(tmp_path):
    """While the mount table is unchanged a poll is a statvfs a mount, and a mount whose numbers
    did not move keeps its usage object (the render's memo and the model step compare it);
    pages written through a mapping, which inotify does not see, show at the next poll; a
    mount on top is a new instance. In a mount namespace of its own (the host's changes
    whenever another test mounts)."""
    point = tmp_path / "dshm"
    point.mkdir()
    in_own_mount_namespace(SAME_USAGE_SCENARIO, str(point))
