"""Which mounts to watch: the configured ones, and in node mode every pod's shm.

Discovery is its own job. It runs on the poll interval and publishes the mount set to
its subscribers (the watcher, the state store); the collectors read `mounts()` at the
start of each run. No collector drives it, so turning one off freezes nothing.

Node mode (`--mode=node`, one shmwatch per node as a DaemonSet) reads the host's
mountinfo (`--path.procfs=/host/proc`, pid 1, or our own under hidepid) and picks the
tmpfs mounts that are some pod's or container's shared memory (kube.MOUNT_LAYOUTS):
memory-backed emptyDirs, containerd and CRI-O sandbox shm, Docker container shm, and
the host's /dev/shm. node_exporter's defaults drop exactly these (`^/(dev|...)`,
`/var/lib/kubelet/pods/.+`, `/run/containerd/.+`).

When mountinfo cannot be read, the last good set is kept (and the run fails): an
unreadable file must not forget every pod and reset its counters.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, List, Optional, Sequence

from exporter.model.types import MountSet, Target
from exporter.collectors.source import BaseSource
from exporter.host.kube import NODE_LABELS, mount_labels
from exporter.host.mountinfo import MountEntry, WatchedMountinfo
from exporter.host.paths import Paths

log = logging.getLogger(__name__)


def classify_mount(entry: MountEntry) -> Optional[Dict[str, str]]:
    """Labels for a pod/container shm mount; None for any other mount."""
    if entry.fstype != "tmpfs":
        return None
    labels = mount_labels(entry.mount_point)
    if labels is not None:
        return labels
    if entry.mount_point == "/dev/shm":
        return {name: "" for name in NODE_LABELS}
    return None


def discover(entries: Sequence[MountEntry]) -> List[Target]:
    found: Dict[str, Target] = {}
    for entry in entries:  # later entries stack on earlier ones: the last one wins
        labels = classify_mount(entry)
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
        self.paths = paths
        self.node_mode = node_mode
        # In sidecar mode the set never changes and nothing can fail: no status series.
        self.reports_status = node_mode
        self._static = [
            Target(m, {n: "" for n in NODE_LABELS} if node_mode else {})
            for m in static_mounts
        ]
        self._lock = threading.Lock()
        self._current = MountSet(list(self._static))
        self._subscribers: List[Callable[[MountSet], None]] = []
        # The host's view is pid 1's (the DaemonSet runs with hostPID); under hidepid ours.
        self._mountinfo = WatchedMountinfo(paths, ("1", "self"))

    def subscribe(self, subscriber: Callable[[MountSet], None]) -> None:
        self._subscribers.append(subscriber)

    def collect(self) -> MountSet:
        """Re-discover (node mode) and publish. Raises, keeping the last good set, when the
        host's mountinfo cannot be read."""
        if self.node_mode:
            # The host's mounts, --path.rootfs stripped from our own view's; None: unchanged.
            entries = self._mountinfo.read()
            if entries is None:  # the mount table did not change: neither did the set
                return self._publish()
            if not entries:
                raise ValueError("mountinfo is empty: keeping the last mount set")
            found = discover(entries)
            seen = {t.mount for t in found}
            current = MountSet(
                found + [t for t in self._static if t.mount not in seen],
                follows_mount_table=True,
            )
            with self._lock:
                self._current = current
        return self._publish()

    def _publish(self) -> MountSet:
        for subscriber in self._subscribers:
            subscriber(self.current())
        return self.current()

    def current(self) -> MountSet:
        with self._lock:
            return self._current

    def mounts(self) -> List[str]:
        return self.current().mounts()
