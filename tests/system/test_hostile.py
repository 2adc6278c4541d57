"""A hostile /dev/shm: odd names, FIFOs, sockets, symlinks out of the mount, churn, 20,000 files.

No crash, no hang, nothing outside the mount touched, nothing inside opened for writing
(the mount is read-only while shmwatch looks at it), and a valid exposition.
"""
import os
import socket
import stat
import subprocess
import threading
import time

import pytest

from exporter.collectors.segments import SegmentsCollector
from exporter.host.paths import Paths
from tests.conftest import (EVERY_FAMILY, HOST_EXCUSED_RE, Exporter, fallocate, mounted_tmpfs, needs_root, promtool_check_metrics,
                            select, value)
from tests.helpers import Runs

pytestmark = needs_root


def populate(root: str, outside: str) -> None:
    b = os.fsencode(root)
    fallocate(os.path.join(b, b"psm_\xff\xfe-invalid-utf8"), 4096)
    fallocate(os.path.join(root, 'nccl-new\nline "quoted" \\ back'), 8192)
    fallocate(os.path.join(root, "torch_" + "x" * 249), 4096)  # a 255-byte name
    fallocate(os.path.join(root, "esc\x1b[31mred"), 4096)
    os.mkfifo(os.path.join(root, "nccl-fifo"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(root, "ucx_shm_posix_socket"))
    sock.close()
    os.symlink("/etc/shadow", os.path.join(root, "psm_to_shadow"))
    os.mkfifo(os.path.join(outside, "fifo"))
    os.symlink(os.path.join(outside, "fifo"), os.path.join(root, "psm_to_fifo"))
    with open(os.path.join(outside, "canary"), "w") as f:
        f.write("x")
    two_days_ago = time.time() - 2 * 86400
    os.utime(os.path.join(outside, "canary"), (two_days_ago, two_days_ago))
    os.symlink(os.path.join(outside, "canary"), os.path.join(root, "psm_to_canary"))
    os.mkdir(os.path.join(root, "subdir"))
    fallocate(os.path.join(root, "subdir", "sem.inner"), 4096)
    fallocate(os.path.join(root, "psm_linked_a"), 4096)
    os.link(os.path.join(root, "psm_linked_a"), os.path.join(root, "psm_linked_b"))
    for i in range(20000):
        os.close(os.open(os.path.join(root, f"psm_many_{i:05d}"), os.O_CREAT | os.O_WRONLY, 0o600))


@pytest.fixture
def outside():
    """Where the symlinks point: a strictatime tmpfs, so that any read there moves the
    file's atime. Under relatime (the default) an atime check only catches a read when
    the atime was older than the mtime or a day old, and under noatime never."""
    with mounted_tmpfs("4m", options=",strictatime") as path:
        yield path


def test_hostile_corpus(tmpfs, outside):
    populate(tmpfs, outside)
    canary_atime = os.stat(os.path.join(outside, "canary")).st_atime
    # The control: a read on this mount is seen (the atime check below can fail).
    with open(os.path.join(outside, "control"), "w") as f:
        f.write("x")
    past = time.time() - 3600
    os.utime(os.path.join(outside, "control"), (past, past))
    with open(os.path.join(outside, "control")) as f:
        f.read()
    assert os.stat(os.path.join(outside, "control")).st_atime > past + 60

    # Files vanishing between readdir and lstat: churn while the inventory runs.
    stop = threading.Event()

    def churn():
        i = 0
        while not stop.is_set():
            path = os.path.join(tmpfs, f"nccl-churn{i % 50}")
            try:
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
                os.unlink(path)
            except OSError:
                pass
            i += 1

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        runs = Runs(SegmentsCollector(Paths(), ignore_unreadable=HOST_EXCUSED_RE), [tmpfs])
        for _ in range(3):
            inv = runs.full().mounts[0]
    finally:
        stop.set()
        worker.join()
    names = {s.name for s in inv.rows()}
    assert "psm_to_shadow" not in names and "nccl-fifo" not in names
    assert inv.other_entries["symlink"] == 3 and inv.other_entries["fifo"] == 1
    assert inv.other_entries["socket"] == 1 and inv.other_entries["directory"] == 1
    assert "subdir/sem.inner" in names  # named by its path below the mount
    assert len([n for n in names if n.startswith("psm_linked_")]) == 1  # hard links count once
    assert len([n for n in names if n.startswith("psm_many_")]) == 20000

    # Long-lived, all of them (last written an hour ago): old enough to be named.
    hour_ago = time.time() - 3600
    for directory, _, files in os.walk(os.fsencode(tmpfs)):
        for name in files:
            path = os.path.join(directory, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.utime(path, (hour_ago, hour_ago), follow_symlinks=False)
    # Read-only from here: shmwatch needs no write access to the mount.
    subprocess.run(["mount", "-o", "remount,ro", tmpfs], check=True)
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", "--segments.top-k=10", EVERY_FAMILY) as exporter:
        text = exporter.scrape_text()
        samples = exporter.scrape()
        assert exporter.proc.poll() is None
    result = promtool_check_metrics(text)
    assert result.returncode == 0, result.stdout + result.stderr
    assert value(samples, "shmwatch_segments", mount=tmpfs, state="orphan", **{"class": "python_shm"}) >= 20000
    tops = {labels["name"] for labels, _ in select(samples, "shmwatch_top_segment_bytes", mount=tmpfs)}
    assert len(tops) == 10
    assert 'nccl-new\\x0aline "quoted" \\ back' in tops  # control characters spelled out
    assert "psm_\ufffd\ufffd-invalid-utf8" in tops
    assert all(len(n) <= 128 for n in tops)
    assert "esc\\x1b[31mred" in tops
    assert value(samples, "shmwatch_mount_other_entries", mount=tmpfs, type="symlink") == 3
    # Nothing outside the mount was read or opened.
    assert os.stat(os.path.join(outside, "canary")).st_atime == canary_atime  # psm_to_canary never followed
    assert stat.S_ISFIFO(os.lstat(os.path.join(outside, "fifo")).st_mode)
