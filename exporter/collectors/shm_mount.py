"""Watched tmpfs mounts' statvfs and type (mountinfo), not node_exporter's: its default
mount-points-exclude ^/(dev|...) drops /dev/shm; kube-prometheus, emptyDir paths. Runs on
its own thread (the scheduler's): every poll, and a quick run after inotify events."""

import logging
import os
from contextlib import suppress
from dataclasses import replace
from typing import Callable, Dict, List, Optional

from exporter.collectors.source import Context, RunInput, Source, register
from exporter.host.libc import unique_mount_id
from exporter.host.mountinfo import MountEntry, MountTable
from exporter.host.paths import Paths
from exporter.host.said import SaidOnce, SaidRun
from exporter.model.types import MountInstance, MountUsage

log = logging.getLogger(__name__)


def _with_figures(usage: MountUsage, st: os.statvfs_result) -> MountUsage:
    """The usage with a statvfs's figures; itself when they are the same (most polls of
    most mounts: compared before a new object is made)."""
    n, free, unit = st.f_blocks, st.f_bfree, st.f_frsize
    size, used, available = n * unit, (n - free) * unit, st.f_bavail * unit
    if (
        usage.size_bytes == size
        and usage.used_bytes == used
        and usage.available_bytes == available
        and usage.inodes == st.f_files
        and usage.inodes_free == st.f_ffree
    ):
        return usage
    return MountUsage(
        mount=usage.mount,
        fstype=usage.fstype,
        source=usage.source,
        is_mount_point=usage.is_mount_point,
        error=usage.error,
        size_bytes=size,
        used_bytes=used,
        available_bytes=available,
        inodes=st.f_files,
        inodes_free=st.f_ffree,
        instance=usage.instance,
        noswap=usage.noswap,
    )


class ShmMountCollector(Source):
    name = "shm_mount"
    event_driven = True

    def __init__(
        self,
        paths: Paths,
        statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
    ) -> None:
        self.paths = paths
        self.statvfs = statvfs
        self._said = SaidOnce(log)
        self._polled = False  # the table was read (quick runs reuse the last poll's)
        self._last: Dict[str, MountUsage] = {}  # for quick runs
        self._table = MountTable(paths)
        # Each mount's last full measure while the table is unchanged: all but its numbers hold.
        self._fresh: Dict[str, MountUsage] = {}

    def collect(self, run: RunInput) -> List[MountUsage]:
        """Every mount measured; the mount table read again when it changed."""
        if self._table.refresh():  # read when the table changed, not per mount
            self._fresh = {}
        self._polled = True
        said = self._said.run(
            run.mounts
        )  # node mode: a deleted pod's warnings go with it
        usages = []
        for mount in run.mounts:
            usage = self._fresh[mount] = self.measure(
                mount, said, self._fresh.get(mount)
            )
            usages.append(usage)
        self._last = {u.mount: u for u in usages}
        return usages

    def collect_quick(self, run: RunInput) -> List[MountUsage]:
        """Only the mounts inotify saw change, with the last poll's mountinfo (an event
        mounts nothing, and a node's runs to 2,000 lines); the others as last measured."""
        if not self._polled:
            return self.collect(run)
        said = self._said.run(run.mounts)
        usages = []
        for mount in run.mounts:
            usage = self._last.get(mount)
            if usage is None or mount in run.touched:
                usage = self._fresh[mount] = self.measure(mount, said)
            usages.append(usage)
        self._last = {u.mount: u for u in usages}
        return usages

    def measure(
        self, mount: str, said: SaidRun, last: Optional[MountUsage] = None
    ) -> MountUsage:
        """`last`: its measure since the table last changed; then statvfs alone, and `last`
        itself while its numbers hold (a render's memo and the model step compare it)."""
        if last and not last.error:
            with suppress(OSError):  # else measured whole, which says why
                return _with_figures(last, self.statvfs(self.paths.host(mount)))
        entry = self._table.mounted_at(mount)
        gone = entry is None and self._table.gone(mount)
        if gone:  # the disk beneath is not measured
            said.say(mount, "is not a mount point (unmounted?): not measured")
            return MountUsage(
                mount=mount,
                fstype="unknown",
                source="",
                is_mount_point=False,
                error="not a mount point",
            )
        return self._measure_whole(mount, said, entry)

    def _measure_whole(
        self, mount: str, said: SaidRun, entry: Optional[MountEntry]
    ) -> MountUsage:
        """`entry`: the mount whose mount point the path is; None: the one above holds it."""
        holder = entry or self._table.find(mount)
        fstype, source = (holder.fstype, holder.source) if holder else ("unknown", "")
        usage = MountUsage(
            mount=mount,
            fstype=fstype,
            source=source,
            is_mount_point=entry is not None,
            instance=self._instance(mount, entry),
        )
        try:
            st = self.statvfs(self.paths.host(mount))
        except OSError as err:
            reason = err.strerror or str(err)
            said.say(mount, f"cannot be measured: {reason}")
            return replace(usage, error=reason)  # still this mount: its peaks stand
        where = "is not a mount point" if entry is None else f"is {fstype}, not tmpfs"
        tmpfs = entry is not None and fstype == "tmpfs"
        said.say(
            mount, None if tmpfs else where + "; reporting the filesystem that holds it"
        )
        noswap = bool(holder and "noswap" in holder.options.split(","))
        return _with_figures(replace(usage, noswap=noswap), st)

    def _instance(
        self, mount: str, entry: Optional[MountEntry]
    ) -> Optional[MountInstance]:
        """Which mount this is: a new one at the path starts its peaks afresh (model/state.py)."""
        if entry is None:
            return None
        return MountInstance(
            device=entry.device,
            mount_id=entry.mount_id,
            unique_id=unique_mount_id(self.paths.host(mount)),
        )


def _make(c: Context) -> ShmMountCollector:
    return ShmMountCollector(c.paths)


register("shm_mount", _make)
