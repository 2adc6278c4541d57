# mypy: allow-untyped-calls, disable-error-code="abstract"
"""Host memory from a /proc tree's meminfo: a line the kernel did not print is unknown (None),
never 0 (0 available would fire HostMemoryLow on a host with room)."""

import string
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exporter.collectors.host_memory import HostMemoryCollector, parse_meminfo
from exporter.model.types import HostMemory
from tests.helpers import FakeProc, any_text, fixture


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


def test_meminfo():
    info = parse_meminfo(fixture("proc", "meminfo"))
    assert info["MemTotal"] == 24683568 * 1024
    assert info["MemAvailable"] == 24276128 * 1024
    assert info["Shmem"] == 64 << 20
    assert info["HugePages_Total"] == 0  # no unit: not scaled
    assert "garbage line without colon" not in info


def test_meminfo_corrupt():
    assert parse_meminfo("") == {}
    assert parse_meminfo("MemTotal: lots kB\nShmem:\n:::\n") == {}


meminfo_keys = st.text(string.ascii_letters + string.digits + "_()", min_size=1, max_size=20)


@given(st.dictionaries(meminfo_keys, st.tuples(st.integers(0, 1 << 50), st.booleans()), max_size=40))
def test_meminfo_round_trip(values):
    text = "".join(f"{k + ':':<16}{v:>8}{' kB' if kb else ''}\n" for k, (v, kb) in values.items())
    assert parse_meminfo(text) == {k: v * 1024 if kb else v for k, (v, kb) in values.items()}


@given(any_text)
def test_meminfo_any_text(text):
    assert all(isinstance(v, int) for v in parse_meminfo(text).values())
