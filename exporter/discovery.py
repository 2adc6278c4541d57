"""Which mounts to watch: the configured ones, and in node mode every pod's shm.

Node mode (`--mode=node`, one shmwatch per node as a DaemonSet) reads the host's
mountinfo (`--path.procfs=/host/proc`, pid 1, or our own under hidepid) and picks the
tmpfs mounts that are some pod's or container's shared memory:

- memory-backed emptyDirs:  /var/lib/kubelet/pods/<uid>/volumes/kubernetes.io~empty-dir/<volume>
- containerd sandbox shm:   /run/containerd/io.containerd.grpc.v1.cri/sandboxes/<id>/shm
- CRI-O sandbox shm:        /run/containers/storage/overlay-containers/<id>/userdata/shm
- Docker container shm:     /var/lib/docker/containers/<id>/mounts/shm
- the host's /dev/shm

node_exporter's defaults drop exactly these (`^/(dev|...)`, `/var/lib/kubelet/pods/.+`,
`/run/containerd/.+`). Discovery runs on every poll, so mounts come and go with pods.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .collectors.shm_mount import MountEntry, read_mountinfo
from .paths import Paths

NODE_LABELS: Tuple[str, ...] = ("pod_uid", "volume", "container_id")

# (regex searched in the mount point, which labels it yields). Searched, not anchored, so a
# test may mount the same layout under a temporary directory.
LAYOUTS = (
    (re.compile(r"/var/lib/kubelet/pods/(?P<pod_uid>[^/]+)/volumes/kubernetes\.io~empty-dir/(?P<volume>[^/]+)$"),
     "emptydir"),
    (re.compile(r"/io\.containerd\.grpc\.v1\.cri/sandboxes/(?P<container_id>[0-9a-f]{12,})/shm$"), "containerd"),
    (re.compile(r"/overlay-containers/(?P<container_id>[0-9a-f]{12,})/userdata/shm$"), "crio"),
    (re.compile(r"/var/lib/docker/containers/(?P<container_id>[0-9a-f]{12,})/mounts/shm$"), "docker"),
)


@dataclass(frozen=True)
class Target:
    mount: str  # the mount point as the host sees it (read through --path.rootfs)
    labels: Dict[str, str] = field(default_factory=dict)


def classify_mount(entry: MountEntry) -> Optional[Dict[str, str]]:
    """Labels for a pod/container shm mount; None for any other mount."""
    if entry.fstype != "tmpfs":
        return None
    for pattern, _ in LAYOUTS:
        match = pattern.search(entry.mount_point)
        if match:
            return {name: match.groupdict().get(name) or "" for name in NODE_LABELS}
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


class MountDiscovery:
    """The current list of mounts; static in sidecar mode, re-read from mountinfo in node mode."""

    def __init__(self, paths: Paths, static_mounts: Sequence[str], node_mode: bool = False):
        self.paths = paths
        self.node_mode = node_mode
        self._static = [Target(m, {n: "" for n in NODE_LABELS} if node_mode else {}) for m in static_mounts]
        self._lock = threading.Lock()
        self._current: List[Target] = list(self._static)

    def refresh(self, entries: Optional[Sequence[MountEntry]] = None) -> List[Target]:
        if not self.node_mode:
            return self.current()
        # The host's view is pid 1's (the DaemonSet runs with hostPID).
        found = discover(read_mountinfo(self.paths, host_first=True) if entries is None else entries)
        seen = {t.mount for t in found}
        targets = found + [t for t in self._static if t.mount not in seen]
        with self._lock:
            self._current = targets
        return targets

    def current(self) -> List[Target]:
        with self._lock:
            return list(self._current)

    def mounts(self) -> List[str]:
        return [t.mount for t in self.current()]

    def labels(self, mount: str) -> Dict[str, str]:
        for target in self.current():
            if target.mount == mount:
                return target.labels
        return {n: "" for n in NODE_LABELS} if self.node_mode else {}
