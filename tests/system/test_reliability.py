"""Reliability: load, churn, faults and corrupt input, bounded in time, on 127.0.0.1 only.

Longer versions of the load and soak runs (60 s, 10 min) are in `bench/reliability.py`.
"""
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

from tests.conftest import (EVERY_FAMILY, FIXTURES, Exporter, Peer, fallocate, mounted_tmpfs, needs_root, promtool_check_metrics,
                            select, value)

MiB = 1 << 20


def load(url, clients, seconds):
    """`clients` threads scraping `url` for `seconds` -> (latencies, errors)."""
    latencies, errors, lock = [], [], threading.Lock()
    deadline = time.monotonic() + seconds

    def scraper():
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    body = response.read()
                    ok = response.status == 200 and b"shmwatch_build_info" in body
            except OSError as err:
                ok, body = False, str(err).encode()
            with lock:
                (latencies if ok else errors).append(time.monotonic() - started if ok else body[:200])

    threads = [threading.Thread(target=scraper) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, errors


def rss_and_fds(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


@needs_root
def test_fifty_concurrent_scrapers(tmpfs):
    for i in range(200):
        fallocate(os.path.join(tmpfs, f"psm_{i}"), 4096)
    # --web.max-requests as many as the scrapers: at the default (40, node_exporter's) the
    # 41st request in flight is answered 503 at once, as it should be.
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", "--web.max-requests=50") as exporter:
        latencies, errors = load(exporter.url, clients=50, seconds=15)
        alive = exporter.proc.poll() is None
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    print(f"\nload: 50 scrapers x 15 s: {len(latencies)} scrapes, {len(errors)} errors, "
          f"p50 {latencies[len(latencies) // 2] * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    assert not errors and alive and len(latencies) > 500


@needs_root
def test_churn_soak_has_bounded_rss_and_fds():
    """RSS measured after a warm-up, against the number of segments churned: a leak of
    even 100 bytes per created segment (an inode kept in a set, an event kept in a list)
    shows as several MiB. Names cycle through 1,000, as NCCL's do across restarts only in
    their count: the class cache, bounded by its own size and tested in
    tests/unit/model/test_classes.py, would otherwise add up to 50,000 names to the growth."""
    seconds = float(os.environ.get("SHMWATCH_SOAK_SECONDS", "30"))
    warm_up = 10000
    with mounted_tmpfs("64m") as shm, Exporter(f"--shm.mount={shm}", "--no-collector.gpu",
                                               "--inventory-interval=1s", EVERY_FAMILY) as exporter:
        deadline, i = time.monotonic() + seconds, 0
        rss0 = fds0 = None
        while time.monotonic() < deadline or i <= warm_up:  # create and delete segments
            fallocate(os.path.join(shm, f"nccl-{i % 1000:08x}"), 65536)
            if i >= 50:
                os.unlink(os.path.join(shm, f"nccl-{(i - 50) % 1000:08x}"))
            i += 1
            if i % 100 == 0:
                exporter.scrape_text()
            if i == warm_up:
                rss0, fds0 = rss_and_fds(exporter.proc.pid)
        time.sleep(2)
        rss1, fds1 = rss_and_fds(exporter.proc.pid)
        created = value(exporter.scrape(), "shmwatch_segment_events_total", mount=shm, event="created",
                        **{"class": "nccl"})
    churned = i - warm_up
    print(f"\nsoak: {seconds:.0f} s, {i} segments created and deleted ({created:.0f} counted); RSS after "
          f"{warm_up}: {rss0 / MiB:.1f} -> {rss1 / MiB:.1f} MiB over {churned} more, open fds {fds0} -> {fds1}")
    assert churned >= 20000, "too little churn to see a leak: a slower machine needs SHMWATCH_SOAK_SECONDS"
    assert rss1 - rss0 < MiB + 48 * churned, f"RSS grew {(rss1 - rss0) / churned:.0f} bytes per segment"
    assert fds1 <= fds0 + 5


@needs_root
def test_full_mount_leaves_the_exporter_unaffected(tmpfs):
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", "--poll-interval=200ms", EVERY_FAMILY) as exporter:
        with open(os.path.join(tmpfs, "psm_everything"), "wb") as f:
            with pytest.raises(OSError):  # ENOSPC
                while True:
                    f.write(b"\1" * MiB)
                    f.flush()
        s = exporter.wait_for(lambda s: value(s, "shmwatch_mount_usage_ratio", mount=tmpfs) > 0.99, timeout=5)
        assert value(s, "shmwatch_collector_success", collector="segments") == 1
        assert value(s, "shmwatch_mount_available_bytes", mount=tmpfs) == 0
        assert promtool_check_metrics(exporter.scrape_text()).returncode == 0


@needs_root
def test_mount_removed_then_re_added(tmp_path):
    path = str(tmp_path / "shm")
    os.makedirs(path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", path], check=True)
    try:
        with Exporter(f"--shm.mount={path}", "--no-collector.gpu", "--poll-interval=200ms", EVERY_FAMILY) as exporter:
            assert value(exporter.scrape(), "shmwatch_mount_error", mount=path) is None  # measured: no error series
            subprocess.run(["umount", path], check=True)
            os.rmdir(path)
            s = exporter.wait_for(lambda s: value(s, "shmwatch_mount_error", mount=path) == 1, timeout=5)
            assert value(s, "shmwatch_mount_size_bytes", mount=path) is None
            os.makedirs(path)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", path], check=True)
            s = exporter.wait_for(lambda s: value(s, "shmwatch_mount_size_bytes", mount=path) == 32 * MiB, timeout=5)
            assert value(s, "shmwatch_mount_error", mount=path) is None
            # inotify follows the new mount: a segment made now is seen at once.
            exporter.wait_for(lambda s: value(s, "shmwatch_inotify_active", mount=path) == 1, timeout=5)
            fallocate(os.path.join(path, "nccl-after"), MiB)
            exporter.wait_for(lambda s: (value(s, "shmwatch_segment_events_total", mount=path, event="created",
                                               **{"class": "nccl"}) or 0) >= 1, timeout=5)
    finally:
        subprocess.run(["umount", "-l", path], check=False)


@needs_root
def test_killed_owner_leaves_an_orphan(tmpfs):
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", "--inventory-interval=300ms") as exporter:
        peer = Peer(tmpfs, "mapped", "nccl-k1ll3d", str(2 * MiB))
        exporter.wait_for(lambda s: value(s, "shmwatch_segments", mount=tmpfs, state="linked",
                                          **{"class": "nccl"}) == 1, timeout=5)
        peer.proc.send_signal(signal.SIGKILL)
        peer.proc.wait()
        s = exporter.wait_for(lambda s: value(s, "shmwatch_segments", mount=tmpfs, state="orphan",
                                              **{"class": "nccl"}) == 1, timeout=5)
        assert value(s, "shmwatch_segment_bytes", mount=tmpfs, state="orphan", **{"class": "nccl"}) == 2 * MiB


# --- corrupt input for every parser ------------------------------------------------------
CORRUPTIONS = {
    "truncated": lambda text: text[: len(text) // 2],
    "empty": lambda text: "",
    "garbage numbers": lambda text: "".join("x" if c.isdigit() else c for c in text),
    "binary": lambda text: "\x00\xff\xfe" * 50,
}
ENABLED = ("cgroup", "host_memory", "process", "segments", "shm_mount", "sysv")
# /proc/self/cgroup or the memory files are always hit; meminfo keeps MemTotal when only
# halved; an empty or digit-less sysvipc/shm is a valid table (no segments), a binary
# one has no header. segments and shm_mount read the real tmpfs.
CORRUPT_FAILS = {
    "truncated": {"cgroup"},
    "empty": {"cgroup", "host_memory"},
    "garbage numbers": {"cgroup", "host_memory"},
    "binary": {"cgroup", "host_memory", "sysv"},
}


@needs_root
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_proc_and_sys_files_still_give_a_valid_exposition(tmp_path, corruption):
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    shutil.copytree(os.path.join(FIXTURES, "proc"), proc)
    shutil.copytree(os.path.join(FIXTURES, "sys"), sys_)
    pid = proc / "4242"
    pid.mkdir()
    (pid / "stat").write_text("4242 (vllm) S 1 4242 4242 0 -1 4194560 100 0 0 0 10 5 0 0 20 0 12 0 123456 1 2\n")
    (pid / "maps").write_text("7f1a00000000-7f1a00400000 rw-s 00000000 00:1a 12 /dev/shm/nccl-x\n")
    mangle = CORRUPTIONS[corruption]
    with mounted_tmpfs("16m") as shm:
        # The fixture tables name the real tmpfs first (a table that names something else
        # where the tmpfs is would make it a vanished mount); then every file is damaged.
        with open("/proc/self/mountinfo") as f:
            [line] = [x for x in f if x.split(" ")[4] == shm]
        for table in (proc / "self" / "mountinfo", proc / "1" / "mountinfo"):
            table.write_text(line + table.read_text())
        for path in [p for p in list(proc.rglob("*")) + list(sys_.rglob("*")) if p.is_file()]:
            path.write_bytes(mangle(path.read_text(errors="replace")).encode("utf-8", "surrogateescape"))
        with Exporter(f"--path.procfs={proc}", f"--path.sysfs={sys_}", f"--shm.mount={shm}",
                      "--no-collector.gpu") as exporter:
            text = exporter.scrape_text()
            s = exporter.scrape()
            log = exporter.log()
    result = promtool_check_metrics(text)
    assert result.returncode == 0, result.stdout + result.stderr
    assert value(s, "shmwatch_mount_size_bytes", mount=shm) == 16 * MiB  # statvfs does not care
    # Which collectors must fail on which damage, and which must not: a collector that
    # swallowed the damage (or one that failed on sound input) changes this table.
    failing = CORRUPT_FAILS[corruption]
    got = {labels["collector"]: v for labels, v in select(s, "shmwatch_collector_success")}
    assert got == {c: 0.0 if c in failing else 1.0 for c in ENABLED}, got
    for name in failing:
        assert log.count(f"collector {name} failed") == 1, log  # said once, with the reason
