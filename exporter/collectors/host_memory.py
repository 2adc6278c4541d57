"""Host memory from /proc/meminfo (MemTotal, MemAvailable, Shmem)."""

from __future__ import annotations

from typing import Dict

from exporter.model.types import HostMemory
from exporter.collectors.source import BaseSource, register
from exporter.host.paths import Paths, read_text


def parse_meminfo(text: str) -> Dict[str, int]:
    """'MemTotal:  24683568 kB' lines -> {'MemTotal': bytes}. Malformed lines are skipped."""
    values: Dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        try:
            number = int(fields[0])
        except (IndexError, ValueError):
            continue
        if len(fields) > 1 and fields[1].lower() == "kb":
            number *= 1024
        values[key.strip()] = number
    return values


class HostMemoryCollector(BaseSource):
    name = "host_memory"

    def __init__(self, paths: Paths):
        self.paths = paths

    def collect(self) -> HostMemory:
        info = parse_meminfo(read_text(self.paths.proc("meminfo")))
        if "MemTotal" not in info:
            raise ValueError(f"{self.paths.proc('meminfo')}: no MemTotal line")
        # MemAvailable exists since Linux 3.14; before that MemFree is the closest thing.
        available = info.get("MemAvailable", info.get("MemFree", 0))
        return HostMemory(info["MemTotal"], available, info.get("Shmem", 0))


register("host_memory", lambda c: HostMemoryCollector(c.paths))
