"""How much a shm mount can really hold, and what filling it does to the memory limit:
the one formula /metrics and `shmwatch check` both report."""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence
from exporter.model.types import CgroupMemory, MountUsage


@dataclass(frozen=True)
class ShmBudget:
    fillable_bytes: int  # min(tmpfs size, --shm.size-limit)
    effective_bytes: int  # fillable, and no more than the memory limit leaves for shm
    # (working set - shm used + fillable) / limit; None without a cgroup limit
    projection: Optional[float]
    room_bytes: Optional[int]  # what the memory limit leaves for shm; None: no limit


def shm_budget(m: MountUsage, cgroup, size_limit=None, memory_limit=None) -> ShmBudget:
    """The sizeLimit counts because older kubelets leave the tmpfs at half of node RAM and
    enforce it by eviction; the memory limit because tmpfs pages are charged to the cgroup,
    beside everything else the pod uses. `memory_limit` stands in where no cgroup was read."""
    fillable = min(m.size_bytes, size_limit) if size_limit else m.size_bytes
    if cgroup is not None and cgroup.limit_bytes:
        non_shm = max(0, cgroup.working_set_bytes - m.used_bytes)
        room = max(0, cgroup.limit_bytes - non_shm)
        projection = (non_shm + fillable) / cgroup.limit_bytes
        return ShmBudget(fillable, min(fillable, room), projection, room)
    if cgroup is None and memory_limit:
        return ShmBudget(fillable, min(fillable, memory_limit), None, memory_limit)
    return ShmBudget(fillable, fillable, None, None)


def cgroups_by_pod(cgroups: Sequence[CgroupMemory]) -> Dict[str, CgroupMemory]:
    """The cgroup a mount's pages are charged to, by the mount's pod UID: a pod's emptyDir to
    its pod's cgroup, any other mount ("") to the watched cgroup of no pod (the sidecar's
    workload; in node mode none, so the host's /dev/shm is charged to no pod). First wins."""
    return {cgroup.pod_uid: cgroup for cgroup in reversed(cgroups)}
