// Alert rules for shmwatch. Every metric used here is in exporter/model/catalogue.py
// (tests/system/test_rules.py checks it); each alert has firing and quiet scenarios with exact
// values in tests/rules/ (promtool test rules; every side of every and/or/unless) and a
// section in deploy/prometheus/runbook.md.
local lib = import 'lib.libsonnet';
local num = lib.num;
local oneLine = lib.oneLine;
local named = lib.named;

{
  prometheusAlerts+:: {
    local c = $._config,
    local runbook(alert) = c.runbookUrlPrefix + std.asciiLower(alert),
    // A mount's segments summed over class and state, divided by the mount's size. The sum
    // has exactly the size's labels (the target's, and the mount's: its path, or in node mode
    // its pod and volume or its container), so they match on all of them.
    local shareOfMount(selector) =
      'sum without (class, state) (shmwatch_segment_bytes{%s}) / shmwatch_mount_size_bytes' % selector,
    local usage = 'shmwatch_mount_used_bytes / shmwatch_mount_size_bytes',
    // A cgroup is named by its path, or in node mode a pod's by its pod_uid alone.
    local cgroupKey = 'instance, job, cgroup, pod_uid',
    groups+: [
      {
        name: 'shmwatch-shm',
        rules: [
          {
            alert: 'ShmUsageHigh',
            expr: '%s > %s' % [usage, num(c.shmUsageWarningRatio)],
            'for': c.alertFor.ShmUsageHigh,
            labels: { severity: 'warning' },
            annotations: named({
              summary: '{{ $labels.mount }} is {{ $value | humanizePercentage }} full',
              description: oneLine(|||
                {{ $labels.mount }} on {{ $labels.instance }} is {{ $value | humanizePercentage }} full. NCCL, UCX
                and vLLM fail with "No space left on device" or a Bus error when it fills. Find the largest segments
                in shmwatch_top_segment_bytes; remove leaked ones; or give the pod more shm: docker run
                --shm-size=16g, compose shm_size, or an emptyDir with medium: Memory and sizeLimit (about 16Gi for
                vLLM, 80Gi for TensorRT-LLM).
              |||),
              runbook_url: runbook('ShmUsageHigh'),
            }),
          },
          {
            alert: 'ShmUsageCritical',
            expr: '%s > %s' % [usage, num(c.shmUsageCriticalRatio)],
            'for': c.alertFor.ShmUsageCritical,
            labels: { severity: 'critical' },
            annotations: named({
              summary: '{{ $labels.mount }} is {{ $value | humanizePercentage }} full: shm allocations are about to fail',
              description: oneLine(|||
                {{ $labels.mount }} on {{ $labels.instance }} is {{ $value | humanizePercentage }} full. The next
                NCCL/UCX/multiprocessing segment will fail (ENOSPC or SIGBUS). Remove leaked segments
                (state="orphan" in shmwatch_top_segment_bytes), then raise the size: docker --shm-size, compose
                shm_size, or emptyDir medium: Memory with sizeLimit (vLLM ~16Gi, TensorRT-LLM ~80Gi).
                NCCL_SHM_DISABLE=1 only as a last resort (it moves NCCL traffic off shared memory and is slower).
              |||),
              runbook_url: runbook('ShmUsageCritical'),
            }),
          },
          {
            alert: 'ShmFillingUp',
            // The bytes free within the horizon, at the window's rate: tmpfs has no reserved
            // blocks, so what is free is the size less what is used.
            expr: std.format(
              'shmwatch_mount_size_bytes - predict_linear(shmwatch_mount_used_bytes[%s], %s) < 0 and %s > %s',
              [c.shmFillingUpWindow, num(c.shmFillingUpHorizonSeconds), usage, num(c.shmFillingUpMinUsageRatio)]
            ),
            'for': c.alertFor.ShmFillingUp,
            labels: { severity: 'warning' },
            annotations: named({
              summary: '{{ $labels.mount }} will be full within the hour at the current rate',
              description: oneLine(|||
                At the rate of the last 30 minutes {{ $labels.mount }} on {{ $labels.instance }} runs out of space
                within an hour (free in an hour, extrapolated: {{ $value | humanize1024 }}B). A steady climb is
                usually a leak: look for a growing shmwatch_segments{state="orphan"} or one class growing in
                shmwatch_segment_bytes. Clean the leaked segments or raise the shm size (--shm-size, shm_size,
                emptyDir sizeLimit).
              |||),
              runbook_url: runbook('ShmFillingUp'),
            }),
          },
          {
            alert: 'ShmPeakNearFull',
            expr: std.format(
              'shmwatch_mount_peak_used_bytes / shmwatch_mount_size_bytes > %s and %s <= %s',
              [num(c.shmUsageCriticalRatio), usage, num(c.shmUsageCriticalRatio)]
            ),
            'for': c.alertFor.ShmPeakNearFull,
            labels: { severity: 'warning' },
            annotations: named({
              summary: '{{ $labels.mount }} peaked at {{ $value | humanizePercentage }} between scrapes',
              description: oneLine(|||
                {{ $labels.mount }} on {{ $labels.instance }} reached {{ $value | humanizePercentage }} of its size
                within the peak window although it is lower now: a burst (model load, NCCL init, a large batch of
                multimodal inputs) nearly filled it. The next, slightly larger burst fails. Raise the shm size
                (--shm-size, shm_size, emptyDir sizeLimit) before it does.
              |||),
              runbook_url: runbook('ShmPeakNearFull'),
            }),
          },
          {
            alert: 'ShmDockerDefaultSize',
            expr: std.format(
              'shmwatch_mount_size_bytes <= %s and sum without (class, state) (shmwatch_segments{class=~"%s"}) > 0',
              [num(c.shmDockerDefaultSizeBytes), c.shmDockerDefaultClasses]
            ),
            'for': c.alertFor.ShmDockerDefaultSize,
            labels: { severity: 'warning' },
            annotations: named({
              summary: "{{ $labels.mount }} is Docker's 64 MiB default while NCCL/torch/MPI use it",
              description: oneLine(|||
                {{ $labels.mount }} on {{ $labels.instance }} is only {{ $value | humanize1024 }}B: the
                Docker/containerd default, far too small for NCCL, torch multiprocessing or vLLM. Set docker run
                --shm-size=16g (or --ipc=host), compose shm_size: 16gb, or in Kubernetes mount an emptyDir with
                medium: Memory and sizeLimit: 16Gi (vLLM) / 80Gi (TensorRT-LLM) at /dev/shm.
              |||),
              runbook_url: runbook('ShmDockerDefaultSize'),
            }),
          },
          {
            alert: 'ShmLeakedSegments',
            expr: '%s > %s' % [
              shareOfMount('state="orphan", class=~"%s"' % c.removableClasses),
              num(c.shmLeakedRatio),
            ],
            'for': c.alertFor.ShmLeakedSegments,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'Leaked segments hold {{ $value | humanizePercentage }} of {{ $labels.mount }}',
              description: oneLine(|||
                Segments in {{ $labels.mount }} on {{ $labels.instance }} that no process holds (state="orphan")
                take {{ $value | humanizePercentage }} of it: left by a crashed engine (psm_*, nccl-*,
                vllm_offload_*). A restart may fail with "Insufficient space in /dev/shm". Check
                shmwatch_top_segment_bytes{state="orphan"} (or shmwatch check, which names every one) for names and
                remove them (rm -- /dev/shm/<name>) once no server runs that could still attach to them.
              |||),
              runbook_url: runbook('ShmLeakedSegments'),
            }),
          },
          {
            alert: 'ShmLeakedSegmentsOld',
            expr: 'shmwatch_orphan_oldest_age_seconds > %s' % num(c.orphanMaxAgeSeconds),
            'for': c.alertFor.ShmLeakedSegmentsOld,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'A leaked segment in {{ $labels.mount }} is {{ $value | humanizeDuration }} old',
              description: oneLine(|||
                The oldest segment in {{ $labels.mount }} on {{ $labels.instance }} that no process holds was last
                written {{ $value | humanizeDuration }} ago. Nothing will reclaim it: find it in
                shmwatch_top_segment_bytes{state="orphan"} (or shmwatch check) and remove it (rm -- /dev/shm/<name>).
              |||),
              runbook_url: runbook('ShmLeakedSegmentsOld'),
            }),
          },
          {
            alert: 'ShmHiddenSegmentsLarge',
            expr: '%s > %s' % [shareOfMount('state="hidden"'), num(c.shmHiddenRatio)],
            'for': c.alertFor.ShmHiddenSegmentsLarge,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'Unlinked but still mapped segments hold {{ $value | humanizePercentage }} of {{ $labels.mount }}',
              description: oneLine(|||
                {{ $value | humanizePercentage }} of {{ $labels.mount }} on {{ $labels.instance }} is held by
                segments that were unlinked but are still mapped or open (NCCL >= 2.19, UCX_POSIX_USE_PROC_LINK=y,
                torch file_descriptor strategy, Ray): df counts them, ls does not show them.
                shmwatch check names every one with its holders' pids (shmwatch_top_segment_bytes{state="hidden"}
                names the older ones whose time shmwatch can read: one only mapped needs CAP_SYS_ADMIN to be stat'ed);
                they free the space when they exit. If it keeps growing, a process leaks mappings: restart it.
              |||),
              runbook_url: runbook('ShmHiddenSegmentsLarge'),
            }),
          },
          {
            alert: 'ShmMountMissing',
            expr: 'shmwatch_mount_error == 1',
            'for': c.alertFor.ShmMountMissing,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'shmwatch cannot measure {{ $labels.mount }}',
              description: oneLine(|||
                {{ $labels.mount }} on {{ $labels.instance }} is missing or cannot be measured. In a sidecar, mount
                the workload's shm volume (read-only) at the path given to --shm.mount.
              |||),
              runbook_url: runbook('ShmMountMissing'),
            }),
          },
          {
            alert: 'ShmInventoryDegraded',
            expr: 'shmwatch_inventory_degraded == 1',
            'for': c.alertFor.ShmInventoryDegraded,
            labels: { severity: 'warning' },
            annotations: named({
              summary: '{{ $labels.mount }} holds more files than shmwatch inventories one by one',
              description: oneLine(|||
                {{ $labels.mount }} on {{ $labels.instance }} holds more files than --inventory.max-segments, or
                more than 250,000 entries: a leak storm, most likely. Its segments are counted by class only (or
                kept as last seen), all 'unverified', so ShmLeakedSegments cannot fire: look at shmwatch_segments
                by class and remove what its owner left.
              |||),
              runbook_url: runbook('ShmInventoryDegraded'),
            }),
          },
        ],
      },
      {
        name: 'shmwatch-memory',
        rules: [
          {
            alert: 'PodOomRiskHigh',
            expr: 'shmwatch_cgroup_memory_working_set_bytes / ignoring (limit_from) shmwatch_cgroup_memory_limit_bytes > %s'
                  % num(c.oomRiskRatio),
            'for': c.alertFor.PodOomRiskHigh,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'Working set is {{ $value | humanizePercentage }} of the memory limit',
              description: oneLine(|||
                The working set of cgroup {{ $labels.cgroup }} on {{ $labels.instance }} is {{ $value |
                humanizePercentage }} of its limit; tmpfs pages in /dev/shm count in it. The OOM killer acts at 100
                %. Free leaked shm segments, lower the shm sizeLimit, or raise the container's memory limit.
              |||),
              runbook_url: runbook('PodOomRiskHigh'),
            }),
          },
          {
            alert: 'ShmSizeExceedsMemoryLimit',
            expr: 'shmwatch_shm_oom_projection_ratio > %s' % num(c.shmOomProjectionRatio),
            'for': c.alertFor.ShmSizeExceedsMemoryLimit,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'Filling {{ $labels.mount }} would OOM-kill the pod ({{ $value | humanizePercentage }} of the limit)',
              description: oneLine(|||
                The memory-backed {{ $labels.mount }} on {{ $labels.instance }} is charged to cgroup {{ $labels.cgroup }}: with the current working set, a full mount would need {{ $value |
                humanizePercentage }} of the memory limit, so the pod is OOMKilled before tmpfs ever says ENOSPC.
                Lower the emptyDir sizeLimit to what the limit leaves (shmwatch_mount_effective_size_bytes) or raise
                the memory limit by the difference.
              |||),
              runbook_url: runbook('ShmSizeExceedsMemoryLimit'),
            }),
          },
          {
            alert: 'PodOomKilled',
            expr: 'increase(shmwatch_cgroup_oom_kills_total[%s]) > 0' % c.oomKillWindow,
            'for': c.alertFor.PodOomKilled,
            labels: { severity: 'critical' },
            annotations: named({
              summary: 'The OOM killer killed {{ $value | humanize }} process(es) in {{ $labels.cgroup }}',
              description: oneLine(|||
                cgroup {{ $labels.cgroup }} on {{ $labels.instance }} hit its memory limit and the kernel killed {{
                $value | humanize }} process(es) in the last 10 minutes. Count /dev/shm in the budget:
                shmwatch_cgroup_memory_shmem_bytes shows how much of the usage is tmpfs. Free leaked segments, lower
                the shm sizeLimit, or raise the memory limit.
              |||),
              runbook_url: runbook('PodOomKilled'),
            }),
          },
          {
            alert: 'PodThrottledAtMemoryHigh',
            // A pod's cgroup has no memory.high of its own (MemoryQoS sets its containers'), but
            // its memory.events counts theirs: there, shm against the pod's limit. group_left
            // keeps the shmem series' labels (pod_uid, the target's namespace and pod).
            expr: ('shmwatch_cgroup_memory_shmem_bytes / on (%(k)s) group_left () (max by (%(k)s) '
                   + '(shmwatch_cgroup_memory_high_bytes) or max by (%(k)s) (shmwatch_cgroup_memory_limit_bytes)) '
                   + '> %(ratio)s and on (%(k)s) increase(shmwatch_cgroup_memory_events_total{event="high"}[%(window)s]) > 0')
                  % { k: cgroupKey, ratio: num(c.memoryHighShmRatio), window: c.memoryHighWindow },
            'for': c.alertFor.PodThrottledAtMemoryHigh,
            labels: { severity: 'warning' },
            annotations: named({
              summary: '{{ $labels.cgroup }} is throttled at memory.high, shm {{ $value | humanizePercentage }} of it',
              description: oneLine(|||
                cgroup {{ $labels.cgroup }} on {{ $labels.instance }} (or a container in it) keeps going over memory.high,
                and tmpfs (shm) pages are {{ $value | humanizePercentage }} of its memory.high (of its limit where it
                has none: a pod's). The kernel throttles and reclaims above memory.high, but
                tmpfs pages cannot be reclaimed without swap: the workload stalls instead of failing. Free leaked shm
                segments, lower the shm sizeLimit, or raise the memory limit (memory.high follows it).
              |||),
              runbook_url: runbook('PodThrottledAtMemoryHigh'),
            }),
          },
          {
            alert: 'HostMemoryLow',
            expr: 'shmwatch_host_memory_available_bytes / shmwatch_host_memory_total_bytes < %s' % num(c.hostMemoryAvailableRatio),
            'for': c.alertFor.HostMemoryLow,
            labels: { severity: 'warning' },
            annotations: named({
              summary: '{{ $labels.instance }} has {{ $value | humanizePercentage }} of its memory available',
              description: oneLine(|||
                Host memory available on {{ $labels.instance }} is below 10 % ({{ $value | humanizePercentage }});
                shmwatch_host_memory_shmem_bytes shows how much tmpfs and shm hold. Clean leaked segments or move
                workloads.
              |||),
              runbook_url: runbook('HostMemoryLow'),
            }),
          },
        ],
      },
      {
        name: 'shmwatch-sysv',
        rules: [
          {
            alert: 'SysvSegmentsNearLimit',
            expr: 'shmwatch_sysv_segments / shmwatch_sysv_limit_shmmni > %s' % num(c.sysvNearLimitRatio),
            'for': c.alertFor.SysvSegmentsNearLimit,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'SysV shm segments at {{ $value | humanizePercentage }} of kernel.shmmni',
              description: oneLine(|||
                {{ $labels.instance }} uses {{ $value | humanizePercentage }} of kernel.shmmni; the next shmget()
                (UCX sysv transport, older MPI) fails with ENOSPC. List them with ipcs -m, remove orphans (nattch 0,
                creator and last user exited: shmwatch_sysv_orphan_segments) with ipcrm -m <id>, or raise it:
                sysctl -w kernel.shmmni=8192.
              |||),
              runbook_url: runbook('SysvSegmentsNearLimit'),
            }),
          },
          {
            alert: 'SysvBytesNearLimit',
            expr: 'shmwatch_sysv_bytes / shmwatch_sysv_limit_shmall_bytes > %s' % num(c.sysvNearLimitRatio),
            'for': c.alertFor.SysvBytesNearLimit,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'SysV shm at {{ $value | humanizePercentage }} of kernel.shmall',
              description: oneLine(|||
                SysV segments on {{ $labels.instance }} total {{ $value | humanizePercentage }} of kernel.shmall;
                shmget() fails with ENOSPC beyond it. Remove orphans with ipcs -m / ipcrm -m <id>, or raise
                kernel.shmall (in pages) with sysctl.
              |||),
              runbook_url: runbook('SysvBytesNearLimit'),
            }),
          },
        ],
      },
      {
        // See gpuMemoryUsedRatio in config.libsonnet for why the threshold is that high.
        name: 'shmwatch-gpu',
        rules: [
          {
            alert: 'GpuMemoryNearlyFull',
            expr: 'shmwatch_gpu_memory_used_bytes / shmwatch_gpu_memory_total_bytes > %s' % num(c.gpuMemoryUsedRatio),
            'for': c.alertFor.GpuMemoryNearlyFull,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'GPU {{ $labels.gpu }} memory is {{ $value | humanizePercentage }} used',
              description: oneLine(|||
                GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on {{ $labels.instance }} is {{ $value |
                humanizePercentage }} used: less than 2 % free. Serving engines preallocate ~90 % (vLLM
                --gpu-memory-utilization); the rest belongs to the CUDA context, NCCL and CUDA graphs, and "CUDA out
                of memory" follows. shmwatch_gpu_process_memory_bytes shows who else uses it; lower
                --gpu-memory-utilization or move the other process.
              |||),
              runbook_url: runbook('GpuMemoryNearlyFull'),
            }),
          },
        ],
      },
      {
        name: 'shmwatch-exporter',
        rules: [
          {
            alert: 'ShmwatchDown',
            expr: 'up{%s} == 0' % c.shmwatchSelector,
            'for': c.alertFor.ShmwatchDown,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'shmwatch on {{ $labels.instance }} is not being scraped',
              description: oneLine(|||
                Prometheus cannot scrape shmwatch at {{ $labels.instance }}: shm, cgroup and GPU memory of this pod
                are unwatched. Check the sidecar's logs and that the metrics port is reachable.
              |||),
              runbook_url: runbook('ShmwatchDown'),
            }),
          },
          {
            alert: 'ShmwatchCollectorFailing',
            expr: 'shmwatch_collector_success{collector!="gpu"} == 0',
            'for': c.alertFor.ShmwatchCollectorFailing,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'shmwatch collector {{ $labels.collector }} is failing',
              description: oneLine(|||
                The {{ $labels.collector }} collector of shmwatch on {{ $labels.instance }} has failed for 10
                minutes; its metrics are missing. The exporter's log says why once (permission, missing path, cgroup
                not found).
              |||),
              runbook_url: runbook('ShmwatchCollectorFailing'),
            }),
          },
          // Only where GPUs were seen (shmwatch:gpus_seen, a latch in rules.libsonnet): CPU-only
          // nodes have no driver and must not page, and a GPU that fell off the bus must keep
          // paging however long it stays gone (a look-back window would let the alert resolve).
          {
            alert: 'ShmwatchGpuCollectorFailing',
            expr: 'shmwatch_collector_success{collector="gpu"} == 0 and on (instance, job) shmwatch:gpus_seen',
            'for': c.alertFor.ShmwatchGpuCollectorFailing,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'shmwatch lost the GPUs on {{ $labels.instance }}',
              description: oneLine(|||
                NVML calls from shmwatch on {{ $labels.instance }} fail or hang (--collector.gpu.timeout) where GPUs
                were reported before: a GPU fell off the bus, the driver was reloaded, or an Xid error. Check dmesg
                and nvidia-smi on the node. It fires until NVML answers again; on a node whose GPUs were removed on
                purpose, run shmwatch with --no-collector.gpu.
              |||),
              runbook_url: runbook('ShmwatchGpuCollectorFailing'),
            }),
          },
        ],
      },
    ],
  },
}
