"""A real tmpfs, a real shmwatch process, a real scrape over HTTP, promtool on the text."""
import os

from tests.conftest import Exporter, fallocate, mounted_tmpfs, needs_root, promtool_check_metrics, value

MiB = 1 << 20

PAGE = os.sysconf("SC_PAGE_SIZE")


@needs_root
def test_real_tmpfs_usage_matches_statvfs(tmpfs):
    fallocate(os.path.join(tmpfs, "psm_fill"), 12 << 20)
    st = os.statvfs(tmpfs)
    size, used = st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu") as exporter:
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
    from exporter.model.state import StateStore
    state = StateStore()
    with mounted_tmpfs("8m") as a, mounted_tmpfs("8m") as b:
        collector = ShmMountCollector(Paths(), [a, b], touched=state.drain_touched)
        before = {u.mount: u.used_bytes for u in collector.collect()}
        fallocate(os.path.join(a, "nccl-a"), MiB)
        fallocate(os.path.join(b, "nccl-b"), MiB)
        state.touch(a)
        quick = {u.mount: u.used_bytes for u in collector.collect_quick()}
        assert quick[a] == before[a] + MiB
        assert quick[b] == before[b], "an untouched mount was measured again"
        polled = {u.mount: u.used_bytes for u in collector.collect()}
        assert polled[b] == before[b] + MiB


@needs_root
def test_a_poll_keeps_an_unchanged_mounts_usage_and_measures_a_changed_one_again(tmpfs):
    """Node mode polls 200 mounts a second: one whose statvfs and mount entry did not move
    keeps its usage object, also when other mounts came or went; a write shows at the next
    poll all the same."""
    from exporter.collectors.shm_mount import ShmMountCollector
    from exporter.host.paths import Paths
    collector = ShmMountCollector(Paths(), [tmpfs])
    [first] = collector.collect()
    with mounted_tmpfs("1m"):  # the mount table changed (a pod came): this mount's entry did not
        [again] = collector.collect()
    assert again is first
    fallocate(os.path.join(tmpfs, "psm_grow"), 4 << 20)
    [grown] = collector.collect()
    assert grown is not first and grown.used_bytes - first.used_bytes >= 4 << 20
    assert grown.inodes_free == first.inodes_free - 1
