"""Usage of each monitored tmpfs mount: statvfs, plus its type from mountinfo.

Why not leave this to node_exporter: its default mount-points-exclude matches ^/(dev|...)
so /dev/shm is never reported, and kube-prometheus drops the kubelet's emptyDir paths.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Set

from exporter.collectors.source import BaseSource, register
from exporter.host.libc import unique_mount_id
from exporter.host.mountinfo import MountTable, live_mounts
from exporter.host.paths import Paths
from exporter.host.said import SaidOnce
from exporter.model.types import MountUsage

log = logging.getLogger(__name__)


class ShmMountCollector(BaseSource):
    """statvfs of every mount discovery publishes, with its type and source from mountinfo."""

    name = "shm_mount"
    event_driven = True

    def __init__(
        self,
        paths: Paths,
        mounts: "Sequence[str] | Callable[[], List[str]]",
        statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
        touched: Optional[Callable[[], Set[str]]] = None,
    ):
        self.paths = paths
        self.mounts = live_mounts(mounts)  # discovery's current mounts
        self.statvfs = statvfs
        # The mounts inotify saw change since the last call: a quick run measures those.
        self.touched = touched or (lambda: None)
        self._said = SaidOnce(log)
        self._polled = False  # the table was read (quick runs reuse the last poll's)
        self._last: Dict[str, MountUsage] = {}  # for quick runs
        self._table = MountTable(paths)
        # Each mount's instance (a statx) while the table is unchanged: the same mounts.
        self._instances: Dict[str, tuple] = {}

    def measure_one(self, mount: str, quick: bool = False) -> MountUsage:
        entry = self._table.mounted_at(mount)
        is_point = entry is not None
        if not is_point and self._table.gone(mount):  # the disk beneath is not measured
            self._said.say(mount, "is not a mount point (unmounted?): not measured")
            return MountUsage(mount, "unknown", "", False, error="not a mount point")
        entry = entry or self._table.index.find(mount)
        fstype, source = (entry.fstype, entry.source) if entry else ("unknown", "")
        # Which mount this is: a new one at the path starts its peaks afresh (model/state.py);
        # asked anew in a quick run, whose table may be out of date.
        instance = self._instances.get(mount, ()) if is_point and not quick else ()
        if is_point and not instance:
            unique = unique_mount_id(self.paths.host(mount))
            instance = (entry.device, entry.mount_id, unique)
            self._instances[mount] = () if quick else instance
        usage = partial(MountUsage, mount, fstype, source, is_point, instance=instance)
        try:
            st = self.statvfs(self.paths.host(mount))
        except OSError as err:
            reason = err.strerror or str(err)
            self._said.say(mount, f"cannot be measured: {reason}")
            # still this mount (a passing error): its peaks stand
            return usage(error=reason)
        if fstype != "tmpfs" or not is_point:
            where = f"is {fstype}, not tmpfs" if is_point else "is not a mount point"
            self._said.say(mount, f"{where}; reporting the filesystem that holds it")
        else:
            self._said.say(mount, None)
        return usage(
            size_bytes=st.f_blocks * st.f_frsize,
            used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize,
            available_bytes=st.f_bavail * st.f_frsize,
            inodes=st.f_files,
            inodes_free=st.f_ffree,
            noswap=bool(entry and "noswap" in entry.options.split(",")),
        )

    def collect(self) -> List[MountUsage]:
        if self._table.refresh():  # read when the table changed, not per mount
            self._instances = {}
        self._polled = True
        mounts = self.mounts()
        # node mode: a deleted pod's warning is not kept forever
        self._said.keep(mounts)
        return self._measure(mounts, quick=False)

    def collect_quick(self) -> List[MountUsage]:
        """The mounts inotify saw change, with the last poll's mountinfo (an event mounts
        nothing, and a node's runs to 2,000 lines)."""
        if not self._polled:
            return self.collect()
        return self._measure(self.mounts(), quick=True)

    def _measure(self, mounts: List[str], quick: bool) -> List[MountUsage]:
        touched = self.touched()  # drained on every run: all measured now
        usages = []
        for mount in mounts:
            last = self._last.get(mount)  # a dataclass: true
            if not (quick and touched is not None and mount not in touched and last):
                last = self.measure_one(mount, quick)
            usages.append(last)
        self._last = {u.mount: u for u in usages}
        return usages


register("shm_mount", lambda c: ShmMountCollector(c.paths, c.mounts, touched=c.touched))
