"""SysV shared memory: /proc/sysvipc/shm and the kernel.shm* limits.

UCX's sysv transport (UCX_TLS=sysv) and older MPI/NCCL builds use shmget(); those
segments never appear in /dev/shm, and no common exporter reports them (node_exporter
issue 754).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from ..paths import Paths, read_text


@dataclass(frozen=True)
class SysvSegment:
    key: int
    shmid: int
    size_bytes: int
    nattch: int
    cpid: int
    rss_bytes: int


@dataclass(frozen=True)
class SysvShm:
    segments: List[SysvSegment]
    shmmax_bytes: Optional[int]
    shmall_bytes: Optional[int]
    shmmni: Optional[int]

    @property
    def total_bytes(self) -> int:
        return sum(s.size_bytes for s in self.segments)

    @property
    def resident_bytes(self) -> int:
        return sum(s.rss_bytes for s in self.segments)

    @property
    def orphans(self) -> int:
        return sum(1 for s in self.segments if s.nattch == 0)


def parse_sysvipc_shm(text: str) -> List[SysvSegment]:
    """Columns are found by the header's names (their order changed across kernels)."""
    lines = text.splitlines()
    if not lines:
        return []
    header = lines[0].split()
    col: Dict[str, int] = {name: i for i, name in enumerate(header)}
    if not {"key", "shmid", "size", "nattch"} <= col.keys():
        raise ValueError("sysvipc/shm: unexpected header " + " ".join(header[:8]))
    segments = []
    for line in lines[1:]:
        fields = line.split()
        try:
            segments.append(SysvSegment(
                key=int(fields[col["key"]]), shmid=int(fields[col["shmid"]]), size_bytes=int(fields[col["size"]]),
                nattch=int(fields[col["nattch"]]),
                cpid=int(fields[col["cpid"]]) if "cpid" in col else 0,
                rss_bytes=int(fields[col["rss"]]) if "rss" in col else 0))
        except (ValueError, IndexError):
            continue  # a truncated line
    return segments


def _read_int(path: str) -> Optional[int]:
    try:
        return int(read_text(path).split()[0])
    except (OSError, ValueError, IndexError):
        return None


class SysvCollector:
    name = "sysv"
    schedule = "poll"

    def __init__(self, paths: Paths, page_size: int = os.sysconf("SC_PAGE_SIZE")):
        self.paths = paths
        self.page_size = page_size

    def collect(self) -> SysvShm:
        segments = parse_sysvipc_shm(read_text(self.paths.proc("sysvipc", "shm")))
        shmall = _read_int(self.paths.proc("sys", "kernel", "shmall"))
        return SysvShm(
            segments=segments,
            shmmax_bytes=_read_int(self.paths.proc("sys", "kernel", "shmmax")),
            shmall_bytes=None if shmall is None else shmall * self.page_size,
            shmmni=_read_int(self.paths.proc("sys", "kernel", "shmmni")),
        )
