"""Which mounts to watch: the configured ones, and in node mode the host's tmpfs mounts that
are a pod's or container's shm (kube.MOUNT_LAYOUTS) and its /dev/shm, which node_exporter's
defaults drop. Published to subscribers (the watcher); collectors read `mounts()` each run.
When mountinfo cannot be read the last good set is kept (and the run fails): an unreadable
file must not forget every pod and reset its counters."""

from pathlib import PurePosixPath
from typing import Callable, Dict, List, Sequence, Tuple

from exporter.model.types import MountSet, Target
from exporter.collectors.source import BaseSource
from exporter.host.kube import NODE_LABELS, mount_labels
from exporter.host.mountinfo import MountEntry, MountTable
from exporter.host.paths import Paths


def discover(entries: Sequence[MountEntry]) -> List[Target]:
    found: Dict[str, Target] = {}
    for entry in entries:  # later entries stack on earlier ones: the last one wins
        labels = None
        if entry.fstype == "tmpfs":
            labels = mount_labels(entry.mount_point)
            if labels is None and entry.mount_point == "/dev/shm":  # the host's
                labels = {name: "" for name in NODE_LABELS}
        if labels is not None:
            found[entry.mount_point] = Target(entry.mount_point, labels)
        elif entry.mount_point in found:
            del found[entry.mount_point]  # something else was mounted over it
    return sorted(found.values(), key=lambda t: t.mount)


class MountDiscovery(BaseSource):
    """The current mount set; static in sidecar mode, re-read from the host's mountinfo in node mode."""

    name = "discovery"

    def __init__(
        self, paths: Paths, static_mounts: Sequence[str], node_mode: bool = False
    ):
        # In sidecar mode the set never changes and nothing can fail: no status series.
        self.reports_status = self.node_mode = node_mode
        labels = dict.fromkeys(NODE_LABELS, "") if node_mode else {}
        self._static = [Target(m, dict(labels)) for m in static_mounts]
        self._current = MountSet(list(self._static))
        self._ids: List[Tuple[str, int]] = []  # (mount point, ID) at or above targets
        self._subscribers: List[Callable[[MountSet], None]] = []
        # The host's view is pid 1's (the DaemonSet runs with hostPID); under hidepid ours.
        self._mountinfo = MountTable(paths, ("1", "self"))
        # Sidecar: our table, to publish the mounts anew when it changed (the watcher re-checks)
        self._ours = MountTable(paths, ("self",))

    def subscribe(self, subscriber: Callable[[MountSet], None]) -> None:
        self._subscribers.append(subscriber)

    def collect(self) -> MountSet:
        # Node mode: the host's mounts, --path.rootfs stripped; None: the table did not
        # change, and neither did the set.
        entries = self._mountinfo.read() if self.node_mode else None
        if entries == []:
            raise ValueError("mountinfo is empty: keeping the last mount set")
        if entries:
            found = discover(entries)
            seen = {t.mount for t in found}
            targets = found + [t for t in self._static if t.mount not in seen]
            # The mounts at each target or above it, by ID: one mounted on top (over a
            # target, static or found, or a directory above it) is another set, which the
            # watcher checks again.
            under = {t.mount for t in targets}
            under |= {str(a) for m in under for a in PurePosixPath(m, "x").parents}
            ids = [
                (e.mount_point, e.mount_id) for e in entries if e.mount_point in under
            ]
            # Replaced whole (one reference, read by other threads as it stands).
            if (targets, ids) != (self._current.targets, self._ids):
                self._current, self._ids = MountSet(targets), ids
        elif not self.node_mode and self._ours.refresh():  # changed, or unreadable
            self._current = MountSet(list(self._static))
        for subscriber in self._subscribers:
            subscriber(self._current)
        return self._current

    def current(self) -> MountSet:
        return self._current

    def mounts(self) -> List[str]:
        return self.current().mounts()
