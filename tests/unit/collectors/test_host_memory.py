# mypy: allow-untyped-calls, disable-error-code="abstract"
"""Host memory from a /proc tree's meminfo: a line the kernel did not print is unknown (None),
never 0 (0 available would fire HostMemoryLow on a host with room)."""

from pathlib import Path

import pytest

from exporter.collectors.host_memory import HostMemoryCollector
from exporter.model.types import HostMemory
from tests.helpers import FakeProc


def collected(tmp_path: Path, meminfo: str) -> HostMemory:
    proc = FakeProc(str(tmp_path))
    proc.write("meminfo", meminfo)
    return HostMemoryCollector(proc.paths).collect()


def test_every_line_read_in_bytes(tmp_path: Path) -> None:
    text = "MemTotal: 1000 kB\nMemFree: 100 kB\nMemAvailable: 600 kB\nShmem: 50 kB\n"
    assert collected(tmp_path, text) == HostMemory(
        total_bytes=1024000, available_bytes=614400, shmem_bytes=51200
    )


def test_memfree_stands_in_for_memavailable_before_linux_3_14(tmp_path: Path) -> None:
    text = "MemTotal: 1000 kB\nMemFree: 100 kB\nShmem: 50 kB\n"
    assert collected(tmp_path, text).available_bytes == 102400


def test_without_memavailable_memfree_or_shmem_they_are_unknown_not_0(
    tmp_path: Path,
) -> None:
    host = collected(tmp_path, "MemTotal: 1000 kB\nBuffers: 10 kB\n")
    assert host == HostMemory(
        total_bytes=1024000, available_bytes=None, shmem_bytes=None
    )


def test_without_memtotal_the_run_fails(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no MemTotal line"):
        collected(tmp_path, "MemAvailable: 600 kB\n")
