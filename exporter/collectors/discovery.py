"""Mounts to watch: the configured ones; in node mode also pod and container shm
tmpfs mounts (kube.MOUNT_LAYOUTS) and the host's /dev/shm, dropped by node_exporter's
defaults. Pushed to subscribers (the watcher); collectors read `mounts()` per run.
Unreadable mountinfo fails the run but keeps the last set: pods and counters stay."""

from pathlib import PurePosixPath
from typing import Callable, Dict, List, Sequence, Tuple

from exporter.model.types import MountSet, Target
from exporter.collectors.source import Source
from exporter.host.kube import NODE_LABELS, mount_labels
from exporter.host.mountinfo import MountEntry, MountTable
from exporter.host.paths import Paths


def discover(entries: Sequence[MountEntry]) -> List[Target]:
    found: Dict[str, Target] = {}
    for e in entries:  # later entries stack on earlier ones: the last one wins
        tmpfs, point = e.fstype == "tmpfs", e.mount_point
        labels = mount_labels(point) if tmpfs else None
        if tmpfs and labels is None and point == "/dev/shm":  # the host's
            labels = dict.fromkeys(NODE_LABELS, "")
        if labels is None:
            found.pop(point, None)  # something else was mounted over it
        else:
            found[point] = Target(point, labels)
    return sorted(found.values(), key=lambda t: t.mount)


class MountDiscovery(Source):
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
        # Node: pid 1's, the host's view (a hostPID DaemonSet); ours under hidepid.
        # Sidecar: ours, published anew on change (the watcher checks the mounts again).
        self._mountinfo = MountTable(paths, ("1", "self") if node_mode else ("self",))

    def subscribe(self, subscriber: Callable[[MountSet], None]) -> None:
        self._subscribers.append(subscriber)

    def collect(self) -> MountSet:
        # Node mode: the host's mounts (None: the table, so the set, did not change).
        entries = self._mountinfo.read() if self.node_mode else None
        if entries == []:
            raise ValueError("mountinfo is empty: keeping the last mount set")
        if entries:
            found = discover(entries)
            seen = {t.mount for t in found}
            targets = found + [t for t in self._static if t.mount not in seen]
            # The mounts at or above each target, by ID: one mounted on top (over a target
            # or a directory above it) is another set, which the watcher checks again.
            under = {t.mount for t in targets}
            under |= {str(a) for m in under for a in PurePosixPath(m, "x").parents}
            ids = [
                (e.mount_point, e.mount_id) for e in entries if e.mount_point in under
            ]
            # Replaced whole (one reference, read by other threads as it stands).
            if (targets, ids) != (self._current.targets, self._ids):
                self._current, self._ids = MountSet(targets), ids
        elif not self.node_mode and self._mountinfo.refresh():  # changed, or unreadable
            self._current = MountSet(list(self._static))
        for subscriber in self._subscribers:
            subscriber(self._current)
        return self._current

    def current(self) -> MountSet:
        return self._current

    def mounts(self) -> List[str]:
        return self.current().mounts()
