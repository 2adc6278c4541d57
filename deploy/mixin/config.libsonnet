// Every threshold, window, duration and selector of the shmwatch alerts, recording rules
// and dashboard. Override in your own mixin:
//   (import 'shmwatch/mixin.libsonnet') + { _config+:: { shmUsageWarningRatio: 0.7 } }
{
  _config+:: {
    // Which scrape jobs are shmwatch (the ShmwatchDown alert looks at their `up`).
    shmwatchSelector: 'job=~".*shmwatch.*"',
    // kube-prometheus' scrape jobs (kubernetes-mixin's defaults): the kubelet's cAdvisor
    // endpoint and kube-state-metrics, for the shmwatch-kube recording rules.
    cadvisorSelector: 'job="kubelet", metrics_path="/metrics/cadvisor"',
    kubeStateMetricsSelector: 'job="kube-state-metrics"',

    // /dev/shm (and every watched tmpfs): used / size.
    shmUsageWarningRatio: 0.8,
    shmUsageCriticalRatio: 0.95,  // also: a peak above it between scrapes (ShmPeakNearFull)
    // ShmFillingUp: free bytes extrapolated over this window reach 0 within the horizon,
    // on a mount already this full (an empty mount filling up fast is a model load).
    shmFillingUpWindow: '30m',
    shmFillingUpHorizonSeconds: 3600,
    shmFillingUpMinUsageRatio: 0.5,
    // Docker's and containerd's default /dev/shm (64 MiB), while these classes use it.
    shmDockerDefaultSizeBytes: 64 * 1024 * 1024,
    shmDockerDefaultClasses: 'nccl|torch|python_shm|mpi',
    // Classes whose segments belong to one process: an orphan of one of them is a leak to
    // remove (exporter/model/classes.py REMOVABLE; tests/project/test_mixin.py holds them equal).
    // Not semaphores (meant to outlive their creator), not `other` (a container engine's
    // lock file is not ours to judge).
    removableClasses: 'nccl|torch|python_shm|vllm_offload|ucx|mpi|sglang',
    // Leaked (orphan) and hidden segments, as a share of the mount.
    shmLeakedRatio: 0.1,
    orphanMaxAgeSeconds: 6 * 3600,
    shmHiddenRatio: 0.5,

    // Memory: working set / limit, and (working set - shm used + shm size) / limit.
    oomRiskRatio: 0.9,
    shmOomProjectionRatio: 1,
    oomKillWindow: '10m',
    // memory.high (MemoryQoS): throttled within this window while shm is this much of it.
    memoryHighWindow: '10m',
    memoryHighShmRatio: 0.5,
    hostMemoryAvailableRatio: 0.1,

    // SysV: segments / kernel.shmmni and bytes / kernel.shmall.
    sysvNearLimitRatio: 0.9,

    // GPU memory used / total. vLLM preallocates --gpu-memory-utilization (0.9 by default)
    // of each GPU for weights and KV cache at start-up, and TensorRT-LLM / SGLang do
    // likewise: 90 % used is the healthy steady state, and an 80 % or 90 % threshold would
    // fire forever. What hurts is the last few percent (CUDA context, NCCL buffers, CUDA
    // graphs, other processes live outside that budget).
    gpuMemoryUsedRatio: 0.98,

    // How long each condition must hold before the alert fires.
    alertFor: {
      ShmUsageHigh: '5m',
      ShmUsageCritical: '1m',
      ShmFillingUp: '10m',
      ShmPeakNearFull: '0m',
      ShmDockerDefaultSize: '5m',
      ShmLeakedSegments: '15m',
      ShmLeakedSegmentsOld: '15m',
      ShmHiddenSegmentsLarge: '30m',
      ShmMountMissing: '5m',
      ShmInventoryDegraded: '15m',
      PodOomRiskHigh: '5m',
      ShmSizeExceedsMemoryLimit: '15m',
      PodOomKilled: '0m',
      PodThrottledAtMemoryHigh: '5m',
      HostMemoryLow: '5m',
      SysvSegmentsNearLimit: '5m',
      SysvBytesNearLimit: '5m',
      GpuMemoryNearlyFull: '10m',
      ShmwatchDown: '5m',
      ShmwatchCollectorFailing: '10m',
      ShmwatchGpuCollectorFailing: '5m',
      ShmRecommendationExceedsMemoryLimit: '30m',
    },

    // The shm size recommendation: the highest peak over this window, times this headroom
    // (exporter/check/recommend.py's defaults for `shmwatch check --recommend` are the same), and
    // how often its rules are evaluated.
    recommendationWindow: '7d',
    recommendationHeadroom: 1.25,
    recommendationInterval: '5m',

    runbookUrlPrefix: 'https://github.com/shmwatch/shmwatch/blob/main/deploy/prometheus/runbook.md#',

    // Dashboard.
    dashboardUid: 'shmwatch',
    dashboardTitle: 'shmwatch: shared memory, OOM risk and GPU memory',
    dashboardRefresh: '30s',
    dashboardTimeFrom: 'now-1h',
  },
}
