"""Every metric shmwatch exports: /metrics, README, rules and panels use no other.

The cardinality budget is part of the contract. By default shmwatch exports the families
marked `default=True`: in node mode, the series that say of each pod how full its shm is,
how big, what class of segments fill it, what is leaked and what memory budget it is
charged to, and what the alerts and the dashboard read; at most SERIES_A_POD_BUDGET series
a pod (a memory emptyDir and its memory cgroup) and BYTES_A_SERIES_BUDGET bytes a series of
the text format at the kubelet's paths (bench/cardinality.py prints both). The rest are
opt-in (--metric-opt-in-list adds them to the default set), and --metric-allowlist or
--metric-denylist filter what that leaves (kube-state-metrics' three flags).

Label values are bounded: a segment's name only for the segments --segments.top-k names on
the exporter (leaks first: orphans last modified over 15 s ago, then any segment last
modified over a minute ago: model/summary.py's named_now), a process by its name (comm),
never its pid; `shmwatch check` names every segment and pid.
"""

import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, Sequence, Tuple

from exporter.host.kube import NODE_LABELS as NODE_MOUNT_LABELS

SERIES_A_POD_BUDGET = 20
BYTES_A_SERIES_BUDGET = 150


@dataclass(frozen=True)
class Metric:
    name: str
    # "counter" when the name ends in _total, else "gauge".
    type: str
    # "bytes", "seconds", "ratio", or "" (a count or an info metric).
    unit: str
    labels: Tuple[str, ...]
    help: str
    # In the default set; False: opt-in (--metric-opt-in-list).
    default: bool


CATALOGUE: Tuple[Metric, ...] = (
    # --- shm mounts (collector shm_mount) ------------------------------------------------
    Metric(
        name="shmwatch_mount_info",
        type="gauge",
        unit="",
        labels=("mount", "fstype", "source", "noswap"),
        help="Always 1; the filesystem type and source of a monitored mount; noswap "
        '"true" when mounted with noswap (Linux 6.4+; the kubelet\'s memory-backed '
        "emptyDirs), so its pages cannot go to swap.",
        default=False,
    ),
    Metric(
        name="shmwatch_mount_error",
        type="gauge",
        unit="",
        labels=("mount",),
        help="1 while the mount cannot be measured (missing, no longer a mount point, not "
        "a directory, statvfs failed); absent while it can (its size and used bytes are "
        "there instead).",
        default=True,
    ),
    Metric(
        name="shmwatch_mount_size_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount",),
        help="Size of the mount (statvfs).",
        default=True,
    ),
    Metric(
        name="shmwatch_mount_used_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount",),
        help="Bytes used on the mount (statvfs).",
        default=True,
    ),
    Metric(
        name="shmwatch_mount_available_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount",),
        help="Bytes available to unprivileged users on the mount (statvfs); on tmpfs size "
        "minus used.",
        default=False,
    ),
    Metric(
        name="shmwatch_mount_usage_ratio",
        type="gauge",
        unit="ratio",
        labels=("mount",),
        help="Used / size, 0 to 1 (the recording rule shmwatch:mount_usage_ratio).",
        default=False,
    ),
    Metric(
        name="shmwatch_mount_peak_used_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount",),
        help="Highest used bytes seen by polls and inotify events within the peak window.",
        default=True,
    ),
    Metric(
        name="shmwatch_mount_max_used_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount",),
        help="High-water mark: highest used bytes seen by polls and inotify events since "
        "the mount was first seen.",
        default=True,
    ),
    Metric(
        name="shmwatch_mount_max_used_timestamp_seconds",
        type="gauge",
        unit="seconds",
        labels=("mount",),
        help="When shmwatch_mount_max_used_bytes was first reached (Unix time).",
        default=False,
    ),
    Metric(
        name="shmwatch_mount_inodes",
        type="gauge",
        unit="",
        labels=("mount",),
        help="Inodes on the mount.",
        default=False,
    ),
    Metric(
        name="shmwatch_mount_inodes_free",
        type="gauge",
        unit="",
        labels=("mount",),
        help="Free inodes on the mount.",
        default=False,
    ),
    # --- segment inventory (collector segments) ------------------------------------------
    Metric(
        name="shmwatch_segments",
        type="gauge",
        unit="",
        labels=("mount", "class", "state"),
        help="Segments by owner class and state: linked, hidden (unlinked, still mapped or "
        "open), orphan (held by no process, and every process was inspected), unverified "
        "(held by no process we could inspect).",
        default=True,
    ),
    Metric(
        name="shmwatch_segment_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount", "class", "state"),
        help="Allocated bytes of segments (st_blocks x 512: what tmpfs charges).",
        default=True,
    ),
    Metric(
        name="shmwatch_segment_apparent_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount", "class", "state"),
        help="Apparent size of segments (st_size: what was asked for; sparse files "
        "allocate less).",
        default=False,
    ),
    Metric(
        name="shmwatch_top_segment_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount", "name", "class", "state", "owner"),
        help="Allocated bytes of the segments to act on, by name: leaks first (orphans last "
        "modified over 15 s ago), then segments last modified over a minute ago, largest "
        "first; --segments.top-k of them on the exporter, not per mount. owner: the process "
        "name (comm) of the first holder. A segment that lives seconds is never named: "
        "shmwatch check names every segment and its holders' pids.",
        default=True,
    ),
    Metric(
        name="shmwatch_process_shm_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount", "comm"),
        help="Allocated bytes of the mount's segments that a process maps or holds open, "
        "the most of any process of that name (comm), for the names of the --segments.top-k "
        "processes holding most; in node mode process_pod_uid is the processes' pod.",
        default=False,
    ),
    Metric(
        name="shmwatch_orphan_oldest_age_seconds",
        type="gauge",
        unit="seconds",
        labels=("mount",),
        help="Age in whole seconds (since last modification) of the oldest orphan segment "
        "of a class whose segments belong to one process (nccl, torch, python_shm, "
        "vllm_offload, ucx, mpi, sglang): one to remove; 0 when there is none; absent "
        "while the mount is degraded (shmwatch_inventory_degraded).",
        default=True,
    ),
    Metric(
        name="shmwatch_mount_unattributed_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount",),
        help="Used bytes not accounted for by any segment we could see (other users' or "
        "the kernel's).",
        default=False,
    ),
    Metric(
        name="shmwatch_mount_other_entries",
        type="gauge",
        unit="",
        labels=("mount", "type"),
        help="Entries that are not regular files (directory, symlink, fifo, socket, "
        "device); never opened.",
        default=False,
    ),
    Metric(
        name="shmwatch_proc_unreadable",
        type="gauge",
        unit="",
        labels=(),
        help="Processes we could not inspect in the last inventory: /proc stat, maps or fd "
        "denied, or hidden by hidepid; absent when hidden processes exist but could not "
        "be counted.",
        default=True,
    ),
    Metric(
        name="shmwatch_mount_owners_verified",
        type="gauge",
        unit="",
        labels=("mount",),
        help="1 when every process that could hold a segment of the mount was inspected "
        "(segments held by nobody are orphan); 0 when some could not be (they are "
        "unverified: grant the server's UID or CAP_SYS_PTRACE), or while the mount is "
        "degraded.",
        default=False,
    ),
    Metric(
        name="shmwatch_inventory_degraded",
        type="gauge",
        unit="",
        labels=("mount",),
        help="1 when the mount holds more files than --inventory.max-segments: its segments "
        "are counted and sized by class only (state unverified; no top segments, no "
        "owners); or more than 250,000 entries: the files a walk does not reach are kept "
        "as last seen and none is called orphan.",
        default=True,
    ),
    # --- memfd regions (collector segments): shmem outside every mount -------------------
    Metric(
        name="shmwatch_memfd_regions",
        type="gauge",
        unit="",
        labels=("class",),
        help="memfd regions ('/memfd:<name> (deleted)' in a process's maps or fds) mapped "
        "or held open, by the owner class of their name: shmem charged like tmpfs that no "
        "mount shows (Mooncake, UCX, CUDA host allocations).",
        default=True,
    ),
    Metric(
        name="shmwatch_memfd_bytes",
        type="gauge",
        unit="bytes",
        labels=("class",),
        help="Allocated bytes of memfd regions (st_blocks x 512 of the fd, or of the "
        "mapping through map_files with CAP_SYS_ADMIN; else the mapping's extent).",
        default=True,
    ),
    Metric(
        name="shmwatch_process_memfd_bytes",
        type="gauge",
        unit="bytes",
        labels=("comm",),
        help="Allocated bytes of the memfd regions a process maps or holds open, the most "
        "of any process of that name (comm), for the names of the --segments.top-k "
        "processes holding most; in node mode process_pod_uid is the processes' pod. Past "
        "a process's 64 largest, a region another process holds too counts in one of them "
        "only.",
        default=False,
    ),
    Metric(
        name="shmwatch_cgroup_memory_shmem_unexplained_bytes",
        type="gauge",
        unit="bytes",
        labels=("cgroup",),
        help="Estimate: the cgroup's shmem minus what the watched mounts charged to it, its "
        "IPC namespace's SysV segments (resident) and the memfd regions its processes "
        "hold explain, floored at 0: unwatched tmpfs mounts, memfds of processes gone. A "
        "region held from two cgroups counts in both.",
        default=False,
    ),
    # --- events (sampler + watchdog) -----------------------------------------------------
    Metric(
        name="shmwatch_segment_events_total",
        type="counter",
        unit="",
        labels=("mount", "class", "event"),
        help="Segments created and deleted, seen by inotify (or by inventory diffs when "
        "polling); may undercount when the inotify queue overflows "
        "(shmwatch_inotify_overflows_total).",
        default=False,
    ),
    Metric(
        name="shmwatch_inotify_overflows_total",
        type="counter",
        unit="",
        labels=("mount",),
        help="Times the kernel's inotify queue overflowed while the mount was watched: "
        "events were lost, and a full inventory ran at once.",
        default=False,
    ),
    Metric(
        name="shmwatch_inotify_active",
        type="gauge",
        unit="",
        labels=("mount",),
        help="1 when the mount is watched by inotify, 0 when polled.",
        default=False,
    ),
    # --- SysV shm (collector sysv) -------------------------------------------------------
    Metric(
        name="shmwatch_sysv_segments",
        type="gauge",
        unit="",
        labels=(),
        help="SysV shared memory segments (/proc/sysvipc/shm).",
        default=True,
    ),
    Metric(
        name="shmwatch_sysv_bytes",
        type="gauge",
        unit="bytes",
        labels=(),
        help="Total size of SysV shared memory segments.",
        default=True,
    ),
    Metric(
        name="shmwatch_sysv_resident_bytes",
        type="gauge",
        unit="bytes",
        labels=(),
        help="Resident bytes of SysV shared memory segments.",
        default=False,
    ),
    Metric(
        name="shmwatch_sysv_orphan_segments",
        type="gauge",
        unit="",
        labels=(),
        help="SysV segments with no process attached (nattch 0) whose creator and last "
        "user have exited.",
        default=True,
    ),
    Metric(
        name="shmwatch_sysv_limit_shmmax_bytes",
        type="gauge",
        unit="bytes",
        labels=(),
        help="kernel.shmmax: largest SysV segment.",
        default=False,
    ),
    Metric(
        name="shmwatch_sysv_limit_shmall_bytes",
        type="gauge",
        unit="bytes",
        labels=(),
        help="kernel.shmall in bytes: SysV shm in total.",
        default=True,
    ),
    Metric(
        name="shmwatch_sysv_limit_shmmni",
        type="gauge",
        unit="",
        labels=(),
        help="kernel.shmmni: most SysV segments.",
        default=True,
    ),
    Metric(
        name="shmwatch_sysv_namespace_readable",
        type="gauge",
        unit="",
        labels=(),
        help="1 when the IPC namespace's SysV segments and limits could be read; 0 (and no "
        "other SysV series for it) when not: node mode enters each pod's IPC namespace "
        "with setns, which needs CAP_SYS_ADMIN.",
        default=True,
    ),
    # --- host memory (collector host_memory) ---------------------------------------------
    Metric(
        name="shmwatch_host_memory_total_bytes",
        type="gauge",
        unit="bytes",
        labels=(),
        help="MemTotal from meminfo.",
        default=True,
    ),
    Metric(
        name="shmwatch_host_memory_available_bytes",
        type="gauge",
        unit="bytes",
        labels=(),
        help="MemAvailable from meminfo (MemFree before Linux 3.14); absent when it has neither.",
        default=True,
    ),
    Metric(
        name="shmwatch_host_memory_shmem_bytes",
        type="gauge",
        unit="bytes",
        labels=(),
        help="Shmem from meminfo (tmpfs, shm, SysV); absent when it has none.",
        default=True,
    ),
    # --- memory cgroup (collector cgroup) ------------------------------------------------
    Metric(
        name="shmwatch_cgroup_memory_usage_bytes",
        type="gauge",
        unit="bytes",
        labels=("cgroup",),
        help="Memory charged to the cgroup.",
        default=False,
    ),
    Metric(
        name="shmwatch_cgroup_memory_limit_bytes",
        type="gauge",
        unit="bytes",
        labels=("cgroup", "limit_from"),
        help="Effective memory limit: the smallest memory.max from the cgroup up to the "
        "root (v1: hierarchical_memory_limit), or --memory.limit-bytes where tighter; "
        "absent when unlimited. limit_from: pod (a pod's cgroup, the cgroup or above it), "
        "self, ancestor or flag.",
        default=True,
    ),
    Metric(
        name="shmwatch_cgroup_memory_high_bytes",
        type="gauge",
        unit="bytes",
        labels=("cgroup",),
        help="memory.high (v2): above it the cgroup is throttled and reclaimed, and tmpfs "
        'pages cannot be reclaimed without swap; absent when "max".',
        default=True,
    ),
    Metric(
        name="shmwatch_cgroup_memory_events_total",
        type="counter",
        unit="",
        labels=("cgroup", "event"),
        help="memory.events (v2: low, high, max, oom, oom_kill, oom_group_kill); v1: "
        "oom_kill from memory.oom_control and max from memory.failcnt.",
        default=True,
    ),
    Metric(
        name="shmwatch_cgroup_memory_swap_bytes",
        type="gauge",
        unit="bytes",
        labels=("cgroup",),
        help="Swap used by the cgroup (v2 memory.swap.current, v1 memory.stat swap).",
        default=False,
    ),
    Metric(
        name="shmwatch_cgroup_memory_swap_limit_bytes",
        type="gauge",
        unit="bytes",
        labels=("cgroup",),
        help='memory.swap.max (v2); absent when "max" or unknown.',
        default=False,
    ),
    Metric(
        name="shmwatch_cgroup_memory_working_set_bytes",
        type="gauge",
        unit="bytes",
        labels=("cgroup",),
        help="Usage minus inactive file cache, floored at 0 (what the OOM killer looks at).",
        default=True,
    ),
    Metric(
        name="shmwatch_cgroup_memory_shmem_bytes",
        type="gauge",
        unit="bytes",
        labels=("cgroup",),
        help="tmpfs and shm pages charged to the cgroup.",
        default=True,
    ),
    Metric(
        name="shmwatch_cgroup_oom_kills_total",
        type="counter",
        unit="",
        labels=("cgroup",),
        help="OOM kills in the cgroup and below it: the kernel log's reports (collector "
        "oom) or the cgroup's own counter, whichever is higher; never goes down, and in "
        "node mode a deleted pod's logged kills stay for an hour (its counter's go with "
        "its cgroup).",
        default=True,
    ),
    Metric(
        name="shmwatch_cgroup_memory_estimated",
        type="gauge",
        unit="",
        labels=("cgroup",),
        help='1 when the cgroup\'s numbers are an estimate (cgroup="estimate:workload"): a '
        "sidecar that cannot read the workload's cgroup sums its processes' resident anon "
        "and file memory (smaps_rollup Pss) and the shm mounts' used bytes; 0 when read "
        "from the cgroup.",
        default=False,
    ),
    Metric(
        name="shmwatch_oom_risk_ratio",
        type="gauge",
        unit="ratio",
        labels=("cgroup",),
        help="Working set / limit (the recording rule shmwatch:oom_risk_ratio); absent "
        "when unlimited.",
        default=False,
    ),
    Metric(
        name="shmwatch_shm_oom_projection_ratio",
        type="gauge",
        unit="ratio",
        labels=("mount", "cgroup"),
        help="(working set - shm used + shm size) / limit: above 1, filling the mount "
        "OOM-kills the pod first.",
        default=True,
    ),
    Metric(
        name="shmwatch_mount_effective_size_bytes",
        type="gauge",
        unit="bytes",
        labels=("mount",),
        help="min(tmpfs size, --shm.size-limit, what the memory limit leaves for shm); "
        "absent while the memory limit is unknown (cgroup unreadable, no "
        "--memory.limit-bytes).",
        default=True,
    ),
    # --- GPU (collector gpu) -------------------------------------------------------------
    Metric(
        name="shmwatch_gpu_info",
        type="gauge",
        unit="",
        labels=("gpu", "uuid", "name", "driver_version"),
        help="Always 1; one per GPU.",
        default=True,
    ),
    Metric(
        name="shmwatch_gpu_memory_total_bytes",
        type="gauge",
        unit="bytes",
        labels=("gpu", "uuid"),
        help="GPU memory in total (NVML).",
        default=True,
    ),
    Metric(
        name="shmwatch_gpu_memory_used_bytes",
        type="gauge",
        unit="bytes",
        labels=("gpu", "uuid"),
        help="GPU memory not free (NVML), the driver's reserve included: memory info v1's "
        "used, v2's used + reserved.",
        default=True,
    ),
    Metric(
        name="shmwatch_gpu_memory_free_bytes",
        type="gauge",
        unit="bytes",
        labels=("gpu", "uuid"),
        help="GPU memory free (NVML).",
        default=True,
    ),
    Metric(
        name="shmwatch_gpu_memory_reserved_bytes",
        type="gauge",
        unit="bytes",
        labels=("gpu", "uuid"),
        help="GPU memory reserved by the driver, part of used (NVML memory info v2 only).",
        default=True,
    ),
    Metric(
        name="shmwatch_gpu_process_memory_bytes",
        type="gauge",
        unit="bytes",
        labels=("gpu", "uuid", "comm"),
        help="GPU memory used (compute and graphics) by the processes of a name (comm) on "
        "the GPU, summed; in node mode process_pod_uid is their pod. shmwatch check names "
        "each pid.",
        default=True,
    ),
    # --- the exporter itself -------------------------------------------------------------
    Metric(
        name="shmwatch_collector_success",
        type="gauge",
        unit="",
        labels=("collector",),
        help="1 when the collector's last run succeeded.",
        default=True,
    ),
    Metric(
        name="shmwatch_collector_duration_seconds",
        type="gauge",
        unit="seconds",
        labels=("collector",),
        help="Duration of the collector's last run.",
        default=True,
    ),
    Metric(
        name="shmwatch_build_info",
        type="gauge",
        unit="",
        labels=("version",),
        help="Always 1; the shmwatch version.",
        default=True,
    ),
    Metric(
        name="shmwatch_web_config_last_reload_successful",
        type="gauge",
        unit="",
        labels=(),
        help="1 when the last reload of the web config (on a change of its files, or "
        "SIGHUP) was taken; 0 when it was refused (invalid, or it would turn "
        "authentication off) and the previous one serves. Only with --web.config.file or "
        "--web.tls-* flags.",
        default=True,
    ),
    # --- prometheus_client's ProcessCollector (the exporter's own process) ---------------
    Metric(
        name="process_virtual_memory_bytes",
        type="gauge",
        unit="bytes",
        labels=(),
        help="Virtual memory size in bytes.",
        default=True,
    ),
    Metric(
        name="process_resident_memory_bytes",
        type="gauge",
        unit="bytes",
        labels=(),
        help="Resident memory size in bytes.",
        default=True,
    ),
    Metric(
        name="process_start_time_seconds",
        type="gauge",
        unit="seconds",
        labels=(),
        help="Start time of the process since unix epoch in seconds.",
        default=True,
    ),
    Metric(
        name="process_cpu_seconds_total",
        type="counter",
        unit="seconds",
        labels=(),
        help="Total user and system CPU time spent in seconds.",
        default=True,
    ),
    Metric(
        name="process_open_fds",
        type="gauge",
        unit="",
        labels=(),
        help="Number of open file descriptors.",
        default=True,
    ),
    Metric(
        name="process_max_fds",
        type="gauge",
        unit="",
        labels=(),
        help="Maximum number of open file descriptors.",
        default=True,
    ),
)
BY_NAME: Dict[str, Metric] = {m.name: m for m in CATALOGUE}
DEFAULT_SET: FrozenSet[str] = frozenset(m.name for m in CATALOGUE if m.default)


def node_labels(metric: Metric) -> Tuple[str, ...]:
    """Node mode's labels (a series leaves out those it has no value for): a mount's pod and
    volume, or its container (then no `mount`: the path would say it again), the pod of a
    cgroup (then no `cgroup`) or of the processes of a name, the IPC namespace of SysV
    figures."""
    if metric.name.startswith("shmwatch_sysv_"):
        return ("ipc_namespace", "pod_uid", "container_id")
    if metric.name == "shmwatch_process_shm_bytes":
        return NODE_MOUNT_LABELS + ("process_pod_uid",)
    if metric.name in (
        "shmwatch_process_memfd_bytes",
        "shmwatch_gpu_process_memory_bytes",
    ):
        return ("process_pod_uid",)
    if "mount" in metric.labels:
        return NODE_MOUNT_LABELS
    return ("pod_uid",) if "cgroup" in metric.labels else ()


# The families the shipped rules (deploy/prometheus/) and dashboard (grafana/) read, all in
# the default set: an allow- or denylist that leaves one out is warned of at start-up
# (tests/system/test_rules.py and tests/system/test_dashboard.py check this list against what they read).
READ_BY_RULES_AND_DASHBOARD: FrozenSet[str] = frozenset(
    {
        "shmwatch_build_info",
        "shmwatch_cgroup_memory_events_total",
        "shmwatch_cgroup_memory_high_bytes",
        "shmwatch_cgroup_memory_limit_bytes",
        "shmwatch_cgroup_memory_shmem_bytes",
        "shmwatch_cgroup_memory_working_set_bytes",
        "shmwatch_cgroup_oom_kills_total",
        "shmwatch_collector_duration_seconds",
        "shmwatch_collector_success",
        "shmwatch_gpu_info",
        "shmwatch_gpu_memory_reserved_bytes",
        "shmwatch_gpu_memory_total_bytes",
        "shmwatch_gpu_memory_used_bytes",
        "shmwatch_gpu_process_memory_bytes",
        "shmwatch_host_memory_available_bytes",
        "shmwatch_host_memory_shmem_bytes",
        "shmwatch_host_memory_total_bytes",
        "shmwatch_inventory_degraded",
        "shmwatch_mount_effective_size_bytes",
        "shmwatch_mount_error",
        "shmwatch_mount_max_used_bytes",
        "shmwatch_mount_peak_used_bytes",
        "shmwatch_mount_size_bytes",
        "shmwatch_mount_used_bytes",
        "shmwatch_orphan_oldest_age_seconds",
        "shmwatch_proc_unreadable",
        "shmwatch_segment_bytes",
        "shmwatch_segments",
        "shmwatch_shm_oom_projection_ratio",
        "shmwatch_sysv_bytes",
        "shmwatch_sysv_limit_shmall_bytes",
        "shmwatch_sysv_limit_shmmni",
        "shmwatch_sysv_namespace_readable",
        "shmwatch_sysv_orphan_segments",
        "shmwatch_sysv_segments",
        "shmwatch_top_segment_bytes",
    }
)


def _matches(patterns: Sequence[str], name: str) -> bool:
    """Whether a regex matches the whole family name (a counter's with or without _total)."""
    names = (name, name.removesuffix("_total"))
    return any(re.fullmatch(p, n) for p in patterns for n in names)


def _matching(patterns: Sequence[str], names: Iterable[str]) -> FrozenSet[str]:
    return frozenset(n for n in names if _matches(patterns, n))


@dataclass(frozen=True)
class MetricSelection:
    """Which families /metrics shows, as kube-state-metrics' flags choose them: the default
    set and the opt-in families --metric-opt-in-list names; of those, only the ones
    --metric-allowlist names, or all but the ones --metric-denylist names (the two exclude
    each other). Each a tuple of regexes, anchored."""

    allowlist: Tuple[str, ...] = ()
    denylist: Tuple[str, ...] = ()
    opt_in: Tuple[str, ...] = ()

    def offered(self) -> FrozenSet[str]:
        """The default set and the opt-in families asked for, before allow or deny."""
        opt_in = (m.name for m in CATALOGUE if not m.default)
        return DEFAULT_SET | _matching(self.opt_in, opt_in)

    def exposed(self) -> FrozenSet[str]:
        offered = self.offered()
        if self.allowlist:
            return _matching(self.allowlist, offered)
        return offered - _matching(self.denylist, offered)

    def warnings(self) -> Tuple[str, ...]:
        """What start-up logs: each pattern that matches nothing it could (a misspelt name,
        a comma list given as one regex, an opt-in family allowlisted but not opted in), and
        the families the shipped rules and dashboard read that the lists took out."""
        offered = self.offered()
        said = [
            f"--metric-opt-in-list {p!r} matches no opt-in metric family"
            for p in self.opt_in
            if not _matching((p,), BY_NAME.keys() - DEFAULT_SET)
        ]
        for flag, patterns in (
            ("--metric-allowlist", self.allowlist),
            ("--metric-denylist", self.denylist),
        ):
            said += [
                _unmatched(flag, p) for p in patterns if not _matching((p,), offered)
            ]
        removed = sorted(READ_BY_RULES_AND_DASHBOARD - self.exposed())
        if removed:
            said.append(
                "the shipped alerts, recording rules and dashboard read families the "
                f"allow/deny lists leave out: {', '.join(removed)}"
            )
        return tuple(said)


def _unmatched(flag: str, pattern: str) -> str:
    """The warning of a pattern that matches no family offered."""
    if _matching((pattern,), BY_NAME.keys()):
        return (
            f"{flag} {pattern!r} matches only opt-in metric families not asked for: "
            "--metric-opt-in-list adds them"
        )
    return f"{flag} {pattern!r} matches no metric family"


def lookup(name: str) -> Metric:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"metric {name} is not in exporter/model/catalogue.py") from None
