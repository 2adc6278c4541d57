"""Who a synthetic series comes from: the label sets scenarios put on their inputs.

A sidecar's series carry the target labels its PodMonitor adds (namespace and pod of the
workload). Node mode's (the DaemonSet) carry the DaemonSet pod's target labels, and a pod's
series its pod_uid (and a mount's volume) instead of the mount's path and the cgroup's, as
exporter/model/catalogue.py's node_labels say. Empty labels are left out: Prometheus stores
no empty label, and shmwatch writes none.
"""

from __future__ import annotations

from typing import Dict

Labels = Dict[str, str]

SIDECAR: Labels = {"instance": "10.0.0.5:9841", "job": "shmwatch", "namespace": "llm", "pod": "vllm-0"}
NODE: Labels = {"instance": "10.0.1.9:9841", "job": "shmwatch-node", "namespace": "shmwatch", "pod": "shmwatch-node-a"}


def emptydir(uid: str, volume: str = "dshm") -> str:
    return f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/{volume}"


SHM: Labels = {**SIDECAR, "mount": "/dev/shm"}
CACHE: Labels = {**SIDECAR, "mount": "/mnt/cache"}  # a second tmpfs the sidecar watches
POD_SHM: Labels = {**NODE, "pod_uid": "u1", "volume": "dshm"}
CGROUP: Labels = {**SIDECAR, "cgroup": "/"}
POD_CGROUP: Labels = {**NODE, "pod_uid": "u1"}
SYSV_HOST: Labels = {**NODE, "ipc_namespace": "ipc-host"}
SYSV_POD: Labels = {**NODE, "ipc_namespace": "ipc-u1", "pod_uid": "u1"}
GPU: Labels = {**NODE, "gpu": "0", "uuid": "GPU-0"}

MiB = 1 << 20
GiB = 1 << 30
