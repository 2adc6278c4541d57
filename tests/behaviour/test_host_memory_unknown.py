"""A meminfo without MemAvailable, MemFree or Shmem (a kernel or a procfs that does not print
them): the exporter leaves those series out (HostMemoryLow cannot fire on a made-up 0) and
`shmwatch check` says unknown instead of warning. The procfs is the machine's own, every entry
but meminfo reached through a link, as --path.procfs reads a DaemonSet's /host/proc."""

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, Exporter, value

MEMINFO = "MemTotal:       16384000 kB\nBuffers:          10240 kB\nCached:          204800 kB\n"
HOST = "shmwatch_host_memory_"


def procfs_without_lines(root: Path) -> Path:
    proc = root / "proc"
    proc.mkdir()
    for name in os.listdir("/proc"):
        if name != "meminfo":
            os.symlink(f"/proc/{name}", proc / name)
    (proc / "meminfo").write_text(MEMINFO)
    return proc


def test_exporter_leaves_out_what_meminfo_does_not_say(tmp_path: Path) -> None:
    proc = procfs_without_lines(tmp_path)
    with Exporter(
        f"--path.procfs={proc}",
        "--shm.mount=/dev/shm",
        "--no-collector.gpu",
        "--no-collector.segments",
        "--no-collector.cgroup",
    ) as exporter:
        samples = exporter.scrape()
    assert value(samples, HOST + "total_bytes") == 16384000 * 1024
    assert value(samples, HOST + "available_bytes") is None
    assert value(samples, HOST + "shmem_bytes") is None


def test_check_says_unknown_and_does_not_warn(tmp_path: Path) -> None:
    proc = procfs_without_lines(tmp_path)
    argv = [
        sys.executable,
        "-m",
        "exporter",
        "check",
        "--no-collector.gpu",
        "--shm.mount=/dev/shm",
        "--no-collector.cgroup",
        f"--path.procfs={proc}",
    ]
    result = subprocess.run(
        argv,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    [line] = [line for line in result.stdout.splitlines() if "MemAvailable" in line]
    assert "15.6 GiB total, available unknown" in line and "shmem unknown" in line, (
        result.stdout
    )
    assert "free leaked shm" not in result.stdout and "warn" not in line.lower(), (
        result.stdout
    )
