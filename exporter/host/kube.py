"""Where Kubernetes and the container runtimes put things: pod UIDs in cgroup paths
(cgroupfs `pod<uid>`, systemd `pod<uid_with_underscores>.slice`) and emptyDir mount points,
container IDs in the runtimes' shm mount points."""

import functools
import re
from typing import Dict, Optional, Tuple

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
POD_UID_IN_CGROUP = re.compile(r"pod(" + _UID + r")")
# A directory that is a pod's cgroup: its name ends with the pod UID (systemd adds .slice).
POD_CGROUP_DIR = re.compile(r"pod(" + _UID + r")(\.slice)?$")
# Where the kubelet puts pods' cgroups: cgroupfs driver, systemd driver.
POD_CGROUP_ROOTS: Tuple[str, ...] = ("kubepods", "kubepods.slice")
# The labels node mode adds to a mount's series.
NODE_LABELS: Tuple[str, ...] = ("pod_uid", "volume", "container_id")
# Runtime -> the regex searched in its shm mount points. Searched, not anchored, so a test may
# mount the same layout under a temporary directory.
MOUNT_LAYOUTS = {
    "emptydir": r"/var/lib/kubelet/pods/(?P<pod_uid>[^/]+)/volumes/kubernetes\.io~empty-dir/(?P<volume>[^/]+)$",
    "containerd": r"/io\.containerd\.grpc\.v1\.cri/sandboxes/(?P<container_id>[0-9a-f]{12,})/shm$",
    "crio": r"/overlay-containers/(?P<container_id>[0-9a-f]{12,})/userdata/shm$",
    "docker": r"/var/lib/docker/containers/(?P<container_id>[0-9a-f]{12,})/mounts/shm$",
}


def pod_uid_in_cgroup(text: str) -> str:
    """The pod UID in a cgroup path or /proc/<pid>/cgroup text (dashes restored); '' if none."""
    match = POD_UID_IN_CGROUP.search(text)
    return match.group(1).replace("_", "-") if match else ""


def mount_labels(mount_point: str) -> Optional[Dict[str, str]]:
    """Node labels of a pod's or container's shm mount point; None for any other path."""
    for pattern in MOUNT_LAYOUTS.values():  # compiled once, in re's cache
        if match := re.search(pattern, mount_point):
            return {name: match.groupdict().get(name) or "" for name in NODE_LABELS}
    return None


@functools.lru_cache(maxsize=8192)  # asked for every mount by collectors and renders
def pod_uid_of_mount(mount: str) -> str:
    """The pod UID in a kubelet emptyDir path; '' for any other mount."""
    return (mount_labels(mount) or {}).get("pod_uid", "")
