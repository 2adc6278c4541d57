"""Mounts to watch: the configured ones; in node mode also pod and container shm tmpfs
mounts (kube.MOUNT_LAYOUTS) and the host's /dev/shm, dropped by node_exporter's defaults.
Each run's set is published as an observation: the scheduler hands it to every other
source's runs, the watcher watches it and the model labels the mounts with it. Unreadable
mountinfo fails the run; the last set stands (pods and counters stay)."""

from pathlib import PurePosixPath
from typing import Dict, List, Sequence, Set, Tuple

from exporter.collectors.source import RunInput, Source
from exporter.host.kube import NODE_LABELS, mount_labels
from exporter.host.mountinfo import MountEntry, MountTable
from exporter.host.paths import Paths
from exporter.model.types import MountSet, Target

# (mount point, mount ID) of the mounts at or above the targets (node mode).
MountIds = List[Tuple[str, int]]


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
            found[point] = Target(mount=point, labels=labels)
    return sorted(found.values(), key=lambda t: t.mount)


def _at_or_above(targets: Sequence[Target]) -> Set[str]:
    """The targets' mount points and every directory above them."""
    under = {t.mount for t in targets}
    return under | {str(a) for m in under for a in PurePosixPath(m, "x").parents}


class MountDiscovery(Source):
    """Runs on its own thread (the scheduler's), every poll interval."""

    name = "discovery"

    def __init__(
        self, paths: Paths, static_mounts: Sequence[str], node_mode: bool = False
    ) -> None:
        # In sidecar mode the set never changes and nothing can fail: no status series.
        self.reports_status = self.node_mode = node_mode
        labels = dict.fromkeys(NODE_LABELS, "") if node_mode else {}
        self._static = [Target(mount=m, labels=dict(labels)) for m in static_mounts]
        self._current = MountSet(targets=list(self._static))
        self._ids: MountIds = []
        # Node: pid 1's, the host's view (a hostPID DaemonSet); ours under hidepid.
        # Sidecar: ours, published anew on change (the watcher checks the mounts again).
        self._mountinfo = MountTable(paths, ("1", "self") if node_mode else ("self",))

    def collect(self, run: RunInput = RunInput()) -> MountSet:
        """The set; the same object while the mounts at or above the targets are the same
        (the watcher then looks at nothing again)."""
        if self.node_mode:
            self._discover()
        elif self._mountinfo.refresh():  # changed, or unreadable
            # Our own mounts: the set is the same, but a mount on top is another one.
            self._current = MountSet(targets=list(self._static))
        return self._current

    def _discover(self) -> None:
        """Node mode: the host's mounts (None: the table did not change)."""
        entries = self._mountinfo.read()
        if entries == []:
            raise ValueError("mountinfo is empty: keeping the last mount set")
        if not entries:
            return
        found = discover(entries)
        seen = {t.mount for t in found}
        targets = found + [t for t in self._static if t.mount not in seen]
        # The mounts at or above each target, by ID: one mounted on top (over a target or a
        # directory above it) is another set, which the watcher checks again.
        under = _at_or_above(targets)
        ids = [(e.mount_point, e.mount_id) for e in entries if e.mount_point in under]
        if targets != self._current.targets or ids != self._ids:
            self._current, self._ids = MountSet(targets=targets), ids

    def current(self) -> MountSet:
        """The last set found."""
        return self._current
