"""Every metric shmwatch exports: /metrics, README, rules and panels use no other."""

import re
from dataclasses import dataclass
from typing import Dict, Tuple

from exporter.host.kube import NODE_LABELS as NODE_MOUNT_LABELS


@dataclass(frozen=True)
class Metric:
    name: str
    type: str  # "counter" when the name ends in _total, else "gauge"
    unit: str  # "bytes", "seconds", "ratio", "" (a count or an info metric)
    labels: Tuple[str, ...]
    help: str


# name{labels}, two spaces, its help text (on indented lines as it goes on); '#': a comment.
_ENTRY = re.compile(r"^(\w+)(?:{(.*)})?  (.*(?:\n    .*)*)", re.M)
_TABLE = """
# --- shm mounts (collector shm_mount) -------------------------------------------
shmwatch_mount_info{mount,fstype,source,noswap}  Always 1; the filesystem type and
    source of a monitored mount; noswap "true" when mounted with noswap (Linux 6.4+; the
    kubelet's memory-backed emptyDirs), so its pages cannot go to swap.
shmwatch_mount_error{mount}  1 when the mount could not be measured (missing, no longer
    a mount point, not a directory, statvfs failed).
shmwatch_mount_size_bytes{mount}  Size of the mount (statvfs).
shmwatch_mount_used_bytes{mount}  Bytes used on the mount (statvfs).
shmwatch_mount_available_bytes{mount}  Bytes available to unprivileged users on the
    mount (statvfs).
shmwatch_mount_usage_ratio{mount}  Used / size, 0 to 1.
shmwatch_mount_peak_used_bytes{mount}  Highest used bytes seen by polls and inotify
    events within the peak window.
shmwatch_mount_max_used_bytes{mount}  High-water mark: highest used bytes seen by polls
    and inotify events since the mount was first seen.
shmwatch_mount_max_used_timestamp_seconds{mount}  When shmwatch_mount_max_used_bytes was
    first reached (Unix time).
shmwatch_mount_inodes{mount}  Inodes on the mount.
shmwatch_mount_inodes_free{mount}  Free inodes on the mount.
# --- segment inventory (collector segments) -----------------------------------
shmwatch_segments{mount,class,state}  Segments by owner class and state: linked, hidden
    (unlinked, still mapped or open), orphan (held by no process, and every process was
    inspected), unverified (held by no process we could inspect).
shmwatch_segment_bytes{mount,class,state}  Allocated bytes of segments (st_blocks x 512:
    what tmpfs charges).
shmwatch_segment_apparent_bytes{mount,class,state}  Apparent size of segments (st_size:
    what was asked for; sparse files allocate less).
shmwatch_top_segment_bytes{mount,name,class,state,owner}  Allocated bytes of the largest
    segments (top K).
shmwatch_process_shm_bytes{mount,pid,comm}  Allocated bytes of the segments a process
    maps or holds open (top K processes).
shmwatch_orphan_oldest_age_seconds{mount}  Age in whole seconds (since last
    modification) of the oldest orphan segment of a class whose segments belong to one
    process (nccl, torch, python_shm, vllm_offload, ucx, mpi, sglang): one to remove; 0
    when there is none; absent while the mount is degraded
    (shmwatch_inventory_degraded).
shmwatch_mount_unattributed_bytes{mount}  Used bytes not accounted for by any segment we
    could see (other users' or the kernel's).
shmwatch_mount_other_entries{mount,type}  Entries that are not regular files (directory,
    symlink, fifo, socket, device); never opened.
shmwatch_proc_unreadable  Processes we could not inspect in the last inventory: /proc
    stat, maps or fd denied, or hidden by hidepid; absent when hidden processes exist
    but could not be counted.
shmwatch_mount_owners_verified{mount}  1 when every process that could hold a segment of
    the mount was inspected (segments held by nobody are orphan); 0 when some could not
    be (they are unverified: grant the server's UID or CAP_SYS_PTRACE), or while the
    mount is degraded.
shmwatch_inventory_degraded{mount}  1 when the mount holds more files than
    --inventory.max-segments: its segments are counted and sized by class only (state
    unverified; no top segments, no owners); or more than 250,000 entries: the files a
    walk does not reach are kept as last seen and none is called orphan.
# --- memfd regions (collector segments): shmem outside every mount -----------------
shmwatch_memfd_regions{class}  memfd regions ('/memfd:<name> (deleted)' in a process's
    maps or fds) mapped or held open, by the owner class of their name: shmem charged
    like tmpfs that no mount shows (Mooncake, UCX, CUDA host allocations).
shmwatch_memfd_bytes{class}  Allocated bytes of memfd regions (st_blocks x 512 of the
    fd, or of the mapping through map_files with CAP_SYS_ADMIN; else the mapping's
    extent).
shmwatch_process_memfd_bytes{pid,comm}  Allocated bytes of the memfd regions a process
    maps or holds open (top K processes); past its 64 largest, a region another process
    holds too counts in one of them only.
shmwatch_cgroup_memory_shmem_unexplained_bytes{cgroup}  Estimate: the cgroup's shmem
    minus what the watched mounts charged to it, its IPC namespace's SysV segments
    (resident) and the memfd regions its processes hold explain, floored at 0: unwatched
    tmpfs mounts, memfds of processes gone. A region held from two cgroups counts in
    both.
# --- events (sampler + watchdog) ------------------------------------------------
shmwatch_segment_events_total{mount,class,event}  Segments created and deleted, seen by
    inotify (or by inventory diffs when polling); may undercount when the inotify queue
    overflows (shmwatch_inotify_overflows_total).
shmwatch_inotify_overflows_total{mount}  Times the kernel's inotify queue overflowed
    while the mount was watched: events were lost, and a full inventory ran at once.
shmwatch_inotify_active{mount}  1 when the mount is watched by inotify, 0 when polled.
# --- SysV shm (collector sysv) --------------------------------------------------
shmwatch_sysv_segments  SysV shared memory segments (/proc/sysvipc/shm).
shmwatch_sysv_bytes  Total size of SysV shared memory segments.
shmwatch_sysv_resident_bytes  Resident bytes of SysV shared memory segments.
shmwatch_sysv_orphan_segments  SysV segments with no process attached (nattch 0) whose
    creator and last user have exited.
shmwatch_sysv_limit_shmmax_bytes  kernel.shmmax: largest SysV segment.
shmwatch_sysv_limit_shmall_bytes  kernel.shmall in bytes: SysV shm in total.
shmwatch_sysv_limit_shmmni  kernel.shmmni: most SysV segments.
shmwatch_sysv_namespace_readable  1 when the IPC namespace's SysV segments and limits
    could be read; 0 (and no other SysV series for it) when not: node mode enters each
    pod's IPC namespace with setns, which needs CAP_SYS_ADMIN.
# --- host memory (collector host_memory) ---------------------------------------
shmwatch_host_memory_total_bytes  MemTotal from meminfo.
shmwatch_host_memory_available_bytes  MemAvailable from meminfo.
shmwatch_host_memory_shmem_bytes  Shmem from meminfo (tmpfs, shm, SysV).
# --- memory cgroup (collector cgroup) ----------------------------------------------
shmwatch_cgroup_memory_usage_bytes{cgroup}  Memory charged to the cgroup.
shmwatch_cgroup_memory_limit_bytes{cgroup,limit_from}  Effective memory limit: the
    smallest memory.max from the cgroup up to the root (v1: hierarchical_memory_limit),
    or --memory.limit-bytes where tighter; absent when unlimited. limit_from: pod (a
    pod's cgroup, the cgroup or above it), self, ancestor or flag.
shmwatch_cgroup_memory_high_bytes{cgroup}  memory.high (v2): above it the cgroup is
    throttled and reclaimed, and tmpfs pages cannot be reclaimed without swap; absent
    when "max".
shmwatch_cgroup_memory_events_total{cgroup,event}  memory.events (v2: low, high, max,
    oom, oom_kill, oom_group_kill); v1: oom_kill from memory.oom_control and max from
    memory.failcnt.
shmwatch_cgroup_memory_swap_bytes{cgroup}  Swap used by the cgroup (v2
    memory.swap.current, v1 memory.stat swap).
shmwatch_cgroup_memory_swap_limit_bytes{cgroup}  memory.swap.max (v2); absent when "max"
    or unknown.
shmwatch_cgroup_memory_working_set_bytes{cgroup}  Usage minus inactive file cache,
    floored at 0 (what the OOM killer looks at).
shmwatch_cgroup_memory_shmem_bytes{cgroup}  tmpfs and shm pages charged to the cgroup.
shmwatch_cgroup_oom_kills_total{cgroup}  OOM kills in the cgroup and below it: the
    kernel log's reports (collector oom) or the cgroup's own counter, whichever is
    higher; never goes down, and in node mode a pod's stays after its cgroup is gone.
shmwatch_cgroup_memory_estimated{cgroup}  1 when the cgroup's numbers are an estimate
    (cgroup="estimate:workload"): a sidecar that cannot read the workload's cgroup sums
    its processes' resident anon and file memory (smaps_rollup Pss) and the shm mounts'
    used bytes; 0 when read from the cgroup.
shmwatch_oom_risk_ratio{cgroup}  Working set / limit; absent when unlimited.
shmwatch_shm_oom_projection_ratio{mount,cgroup}  (working set - shm used + shm size) /
    limit: above 1, filling the mount OOM-kills the pod first.
shmwatch_mount_effective_size_bytes{mount}  min(tmpfs size, --shm.size-limit, what the
    memory limit leaves for shm); absent while the memory limit is unknown (cgroup
    unreadable, no --memory.limit-bytes).
# --- GPU (collector gpu) ---------------------------------------------------------
shmwatch_gpu_info{gpu,uuid,name,driver_version}  Always 1; one per GPU.
shmwatch_gpu_memory_total_bytes{gpu,uuid}  GPU memory in total (NVML).
shmwatch_gpu_memory_used_bytes{gpu,uuid}  GPU memory not free (NVML), the driver's
    reserve included: memory info v1's used, v2's used + reserved.
shmwatch_gpu_memory_free_bytes{gpu,uuid}  GPU memory free (NVML).
shmwatch_gpu_memory_reserved_bytes{gpu,uuid}  GPU memory reserved by the driver, part of
    used (NVML memory info v2 only).
shmwatch_gpu_process_memory_bytes{gpu,uuid,pid,comm}  GPU memory used by a process
    (compute and graphics).
# --- the exporter itself -----------------------------------------------------------
shmwatch_collector_success{collector}  1 when the collector's last run succeeded.
shmwatch_collector_duration_seconds{collector}  Duration of the collector's last run.
shmwatch_build_info{version}  Always 1; the shmwatch version.
shmwatch_web_config_last_reload_successful  1 when the last reload of the web config (on
    a change of its files, or SIGHUP) was taken; 0 when it was refused (invalid, or it
    would turn authentication off) and the previous one serves. Only with
    --web.config.file or --web.tls-* flags.
# prometheus_client's ProcessCollector (the exporter's own process)
process_virtual_memory_bytes  Virtual memory size in bytes.
process_resident_memory_bytes  Resident memory size in bytes.
process_start_time_seconds  Start time of the process since unix epoch in seconds.
process_cpu_seconds_total  Total user and system CPU time spent in seconds.
process_open_fds  Number of open file descriptors.
process_max_fds  Maximum number of open file descriptors.
"""


def _metric(name: str, labels: str, help_text: str) -> Metric:
    """Type and unit follow from the name, as Prometheus' naming rules have them."""
    base = name.removesuffix("_total")
    unit = "".join(u for u in ("bytes", "seconds", "ratio") if base.endswith("_" + u))
    kind = "gauge" if base == name else "counter"
    labelled = tuple(labels.split(",")) if labels else ()
    return Metric(name, kind, unit, labelled, " ".join(help_text.split()))


CATALOGUE = tuple(_metric(*entry) for entry in _ENTRY.findall(_TABLE))
BY_NAME: Dict[str, Metric] = {m.name: m for m in CATALOGUE}


def node_labels(metric: Metric) -> Tuple[str, ...]:
    """Node mode's labels (values empty where unknown): a mount's pod or container, the pod
    of a cgroup or of a process holding shm, the IPC namespace of SysV figures."""
    if metric.name.startswith("shmwatch_sysv_"):
        return ("ipc_namespace", "pod_uid", "container_id")
    if metric.name == "shmwatch_process_shm_bytes":
        return NODE_MOUNT_LABELS + ("process_pod_uid",)
    if metric.name == "shmwatch_process_memfd_bytes":
        return ("process_pod_uid",)
    if "mount" in metric.labels:
        return NODE_MOUNT_LABELS
    return ("pod_uid",) if "cgroup" in metric.labels else ()


def lookup(name: str) -> Metric:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"metric {name} is not in exporter/model/catalogue.py") from None
