"""Watched tmpfs mounts' statvfs and type (mountinfo), not node_exporter's: its default
mount-points-exclude ^/(dev|...) drops /dev/shm; kube-prometheus, emptyDir paths."""

import logging
import os
from contextlib import suppress
from dataclasses import replace
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Set

from exporter.collectors.source import Source, register
from exporter.host.libc import unique_mount_id
from exporter.host.mountinfo import MountTable, live_mounts
from exporter.host.paths import Paths
from exporter.host.said import SaidOnce
from exporter.model.types import MountUsage

log = logging.getLogger(__name__)
NUMBERS = ("size_bytes", "used_bytes", "available_bytes", "inodes", "inodes_free")


def _numbers(st: os.statvfs_result) -> dict:
    n, free, unit = st.f_blocks, st.f_bfree, st.f_frsize
    numbers = (n * unit, (n - free) * unit, st.f_bavail * unit, st.f_files, st.f_ffree)
    return dict(zip(NUMBERS, numbers))


class ShmMountCollector(Source):
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
        self.touched = touched or (lambda: None)  # a quick run measures only these
        self._said = SaidOnce(log)
        self._polled = False  # the table was read (quick runs reuse the last poll's)
        self._last: Dict[str, MountUsage] = {}  # for quick runs
        self._table = MountTable(paths)
        # Each mount's last full measure while the table is unchanged: all but its numbers hold.
        self._fresh: Dict[str, MountUsage] = {}

    def measure(self, mount: str, last: Optional[MountUsage] = None) -> MountUsage:
        """`last`: its measure since the table last changed; then statvfs alone, and `last`
        itself while its numbers hold (a render's memo and the model step compare it)."""
        if last and not last.error:
            with suppress(OSError):  # else measured whole, which says why
                numbers = _numbers(self.statvfs(self.paths.host(mount)))
                same = numbers.items() <= vars(last).items()
                return last if same else replace(last, **numbers)
        entry = self._table.mounted_at(mount)
        is_point = entry is not None
        if not is_point and self._table.gone(mount):  # the disk beneath is not measured
            self._said.say(mount, "is not a mount point (unmounted?): not measured")
            return MountUsage(mount, "unknown", "", False, error="not a mount point")
        entry = entry or self._table.find(mount)
        fstype, source = (entry.fstype, entry.source) if entry else ("unknown", "")
        # Which mount this is: a new one at the path starts its peaks afresh (model/state.py).
        unique = is_point and unique_mount_id(self.paths.host(mount))
        instance = (entry.device, entry.mount_id, unique) if is_point else ()
        usage = partial(MountUsage, mount, fstype, source, is_point, instance=instance)
        try:
            st = self.statvfs(self.paths.host(mount))
        except OSError as err:
            reason = err.strerror or str(err)
            self._said.say(mount, f"cannot be measured: {reason}")
            # still this mount (a passing error): its peaks stand
            return usage(error=reason)
        where = f"is {fstype}, not tmpfs" if is_point else "is not a mount point"
        where += "; reporting the filesystem that holds it"
        self._said.say(mount, None if fstype == "tmpfs" and is_point else where)
        noswap = bool(entry and "noswap" in entry.options.split(","))
        return usage(noswap=noswap, **_numbers(st))

    def collect(self, quick: bool = False) -> List[MountUsage]:
        """`quick`: only the mounts inotify saw change, with the last poll's mountinfo (an
        event mounts nothing, and a node's runs to 2,000 lines)."""
        mounts = self.mounts()
        if not (quick and self._polled):
            quick, self._polled = False, True
            if self._table.refresh():  # read when the table changed, not per mount
                self._fresh = {}
            self._said.keep(mounts)  # node mode: a deleted pod's warnings go with it
        touched = self.touched()  # drained each run; quick runs hand back the rest
        usages = []
        for mount in mounts:
            last = self._last.get(mount)
            if not (quick and touched is not None and mount not in touched and last):
                fresh = None if quick else self._fresh.get(mount)
                last = self._fresh[mount] = self.measure(mount, fresh)
            usages.append(last)
        self._last = {u.mount: u for u in usages}
        return usages

    def collect_quick(self) -> List[MountUsage]:
        return self.collect(quick=True)


register("shm_mount", lambda c: ShmMountCollector(c.paths, c.mounts, touched=c.touched))
