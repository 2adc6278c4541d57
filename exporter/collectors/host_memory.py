"""Host memory from /proc/meminfo (MemTotal, MemAvailable, Shmem)."""

import logging
from contextlib import suppress
from typing import Dict, Optional

from exporter.model.types import HostMemory
from exporter.collectors.source import RunInput, Source, register
from exporter.host.paths import Paths, read_text
from exporter.host.proctable import parse_meminfo

log = logging.getLogger(__name__)


def meminfo(paths: Paths) -> Dict[str, int]:
    with suppress(OSError):
        return parse_meminfo(read_text(paths.proc("meminfo")))
    return {}


def usable_limit_flag(paths: Paths, flag: Optional[int]) -> Optional[int]:
    """--memory.limit-bytes, None from MemTotal up: the Downward API's limits.memory of
    an unlimited container is the node's allocatable: a huge, safe-looking non-limit."""
    total = meminfo(paths).get("MemTotal")
    if flag is not None and total is not None and flag >= total:
        log.warning("--memory.limit-bytes %d >= MemTotal %d: no limit", flag, total)
        return None
    return flag


class HostMemoryCollector(Source):
    name = "host_memory"

    def __init__(self, paths: Paths):
        self.paths = paths

    def collect(self, run: RunInput = RunInput()) -> HostMemory:
        info = parse_meminfo(read_text(self.paths.proc("meminfo")))
        if "MemTotal" not in info:
            raise ValueError(f"{self.paths.proc('meminfo')}: no MemTotal line")
        # MemAvailable exists since Linux 3.14; before that MemFree is the closest thing.
        # A line missing is unknown (None, no series), never 0: 0 available fires
        # HostMemoryLow on a host with room.
        available = info.get("MemAvailable", info.get("MemFree"))
        return HostMemory(
            total_bytes=info["MemTotal"],
            available_bytes=available,
            shmem_bytes=info.get("Shmem"),
        )

    def close(self) -> None:
        """Nothing is kept open between runs."""


register("host_memory", lambda c: HostMemoryCollector(c.paths))
