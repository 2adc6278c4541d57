"""A real tmpfs, a real shmwatch process, a real scrape over HTTP, promtool on the text."""
import os

from tests.conftest import Exporter, fallocate, needs_root, promtool_check_metrics, value

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
