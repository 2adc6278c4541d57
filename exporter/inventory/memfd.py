"""memfd regions for the inventory: shmem charged like tmpfs that no mount shows, and each
holder's memory cgroup, so the model can subtract them from the cgroup's shmem."""

from __future__ import annotations

from typing import Dict, List, Tuple

from exporter.host.proctable import ProcessTable
from exporter.inventory.holdings import Owners, unlinked_size
from exporter.inventory.maps import memfd_name
from exporter.model.classes import classify
from exporter.model.types import Segment


class MemfdRegions:
    def __init__(self, table: ProcessTable):
        self.table = table
        self._cgroup_of: Dict[tuple, str] = {}  # (pid, start time) -> memory cgroup

    def of(self, owners: Owners) -> Tuple[List[Segment], Dict[int, str]]:
        """(the regions the processes map or hold open one by one, each holder's memory
        cgroup) — of those kept one by one and those counted by class (memfd_rest)."""
        regions = []
        for key, hs in owners.holdings.items():
            if (name := memfd_name(hs[0].path)) is not None:
                pids = tuple(sorted({h.pid for h in hs}))
                size = unlinked_size(hs)
                region = Segment(name, classify(name), "hidden", *size, pids, key)
                regions.append(region)
        holders = {pid for region in regions for pid in region.holders}
        holders |= owners.memfd_rest.keys()
        return regions, self._cgroups(holders, owners)

    def _cgroups(self, pids, owners: Owners) -> Dict[int, str]:
        """Each memfd holder's memory cgroup (as /proc/<pid>/cgroup names it), read once per
        process (pid and start time)."""
        out, known = {}, {}
        for pid in pids:
            proc = owners.holders.get(pid)
            ident = (pid, proc.start_time if proc else None)
            path = self._cgroup_of.get(ident)
            if path is None:
                try:
                    cgroups = self.table.cgroups(pid)
                except OSError:
                    continue
                path = cgroups.get("memory", cgroups.get(""))
            if path is not None:
                out[pid] = known[ident] = path
        self._cgroup_of = known
        return out
