"""The thresholds `shmwatch check` judges by: the same numbers the alert rules carry
(deploy/prometheus/shmwatch-rules.yml; tests/system/test_rules.py holds the two together)."""

SHM_USAGE_WARNING_RATIO = 0.8  # ShmUsageHigh
SHM_USAGE_CRITICAL_RATIO = 0.95  # ShmUsageCritical
OOM_RISK_RATIO = 0.9  # PodOomRiskHigh
SHM_OOM_PROJECTION_RATIO = 1.0  # ShmSizeExceedsMemoryLimit
HOST_MEMORY_AVAILABLE_LOW_RATIO = 0.1  # HostMemoryLow
SYSV_NEAR_LIMIT_RATIO = 0.9  # SysvSegmentsNearLimit, SysvBytesNearLimit
GPU_MEMORY_FULL_RATIO = 0.98  # GpuMemoryNearlyFull
DOCKER_DEFAULT_SHM_BYTES = 64 << 20  # ShmDockerDefaultSize: Docker's, containerd's
OOM_KILL_RECENT_SECONDS = 600  # PodOomKilled: increase(...[10m]) > 0
