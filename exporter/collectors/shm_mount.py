"""Usage of each monitored tmpfs mount: statvfs, plus its type from mountinfo.

Why not leave this to node_exporter: its default mount-points-exclude matches ^/(dev|...)
so /dev/shm is never reported, and kube-prometheus drops the kubelet's emptyDir paths.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Dict, List, Optional, Sequence, Set

from exporter.collectors.source import BaseSource, register
from exporter.host.mountinfo import MountIndex, WatchedMountinfo, live_mounts
from exporter.host.paths import Paths
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
        self._warned: Dict[str, str] = {}
        self._index: Optional[MountIndex] = None  # the last poll's, for quick runs
        self._last: Dict[str, MountUsage] = {}  # for quick runs
        # In a container our own mountinfo is the workload's view; with a host at
        # --path.rootfs, pid 1's is the host's.
        order = ("1", "self") if paths.rootfs not in ("", "/") else ("self", "1")
        self._mountinfo = WatchedMountinfo(paths, order)

    def _warn_once(self, mount: str, message: str) -> None:
        if self._warned.get(mount) != message:
            self._warned[mount] = message
            log.warning("mount %s: %s", mount, message)

    def measure_one(self, mount: str) -> MountUsage:
        entry = self._index.find(mount)
        fstype = entry.fstype if entry else "unknown"
        source = entry.source if entry else ""
        is_point = bool(entry and (entry.mount_point.rstrip("/") or "/") == mount)
        try:
            st = self.statvfs(self.paths.host(mount))
        except OSError as err:
            reason = err.strerror or str(err)
            self._warn_once(mount, f"cannot be measured: {reason}")
            return MountUsage(mount, fstype, source, is_point, error=reason)
        if fstype != "tmpfs" or not is_point:
            where = (
                "is not a mount point" if not is_point else f"is {fstype}, not tmpfs"
            )
            self._warn_once(mount, f"{where}; reporting the filesystem that holds it")
        else:
            self._warned.pop(mount, None)
        return MountUsage(
            mount,
            fstype,
            source,
            is_point,
            size_bytes=st.f_blocks * st.f_frsize,
            used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize,
            available_bytes=st.f_bavail * st.f_frsize,
            inodes=st.f_files,
            inodes_free=st.f_ffree,
            noswap=bool(entry and "noswap" in entry.options.split(",")),
        )

    def collect(self) -> List[MountUsage]:
        try:
            entries = self._mountinfo.read()  # None: unchanged
        except OSError:
            entries = []  # measured anyway, reported as not a mount point
        if self._index is None or entries is not None:
            self._index = MountIndex(
                entries or []
            )  # when the table changed, not per mount
        mounts = self.mounts()
        # Node mode: a deleted pod's warning is not kept forever.
        for gone in [m for m in self._warned if m not in mounts]:
            del self._warned[gone]
        return self._measure(mounts, quick=False)

    def collect_quick(self) -> List[MountUsage]:
        """The mounts inotify saw change, with the last poll's mountinfo (an event mounts
        nothing, and a node's runs to 2,000 lines)."""
        if self._index is None:
            return self.collect()
        return self._measure(self.mounts(), quick=True)

    def _measure(self, mounts: List[str], quick: bool) -> List[MountUsage]:
        touched = self.touched()  # drained on every run: all measured now
        usages = []
        for mount in mounts:
            last = self._last.get(mount)
            if (
                quick
                and touched is not None
                and mount not in touched
                and last is not None
            ):
                usages.append(last)
            else:
                usages.append(self.measure_one(mount))
        self._last = {u.mount: u for u in usages}
        return usages


register("shm_mount", lambda c: ShmMountCollector(c.paths, c.mounts, touched=c.touched))
