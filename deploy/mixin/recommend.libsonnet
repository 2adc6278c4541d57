// Right-sizing the shm volume: the highest peak over a window times a headroom, rounded up
// to a whole GiB (a whole MiB below 1 GiB), and the memory limit that holds it. The same
// formula is exporter/check/recommend.py's (`shmwatch check --recommend`); tests/system/test_recommend.py
// holds the rendered rules to it.
local lib = import 'lib.libsonnet';
local num = lib.num;
local oneLine = lib.oneLine;
local named = lib.named;
local GiB = 1073741824;
local MiB = 1048576;
{
  prometheusRules+:: {
    local c = $._config,
    local scaled = 'shmwatch:mount_observed_peak_bytes * %s' % num(c.recommendationHeadroom),
    groups+: [
      {
        name: 'shmwatch-recommend',
        // A max_over_time over days is not free: every five minutes is often enough for advice.
        interval: c.recommendationInterval,
        rules: [
          // shmwatch_mount_peak_used_bytes is the max between polls and inotify events within
          // --peak-window, so a spike between two scrapes counts.
          {
            record: 'shmwatch:mount_observed_peak_bytes',
            expr: 'max_over_time(shmwatch_mount_peak_used_bytes[%s])' % c.recommendationWindow,
          },
          {
            record: 'shmwatch:mount_recommended_size_bytes',
            expr: 'clamp_min((ceil(%(x)s / %(G)d) * %(G)d and %(x)s >= %(G)d) or ceil(%(x)s / %(M)d) * %(M)d, %(M)d)'
                  % { x: scaled, G: GiB, M: MiB },
          },
          // Everything else the cgroup uses (working set minus this mount's shm) plus the
          // recommendation, rounded up to a whole MiB. Joined on the pod (node mode) or the
          // instance (sidecar: no pod_uid on either side).
          {
            record: 'shmwatch:mount_recommended_memory_limit_bytes',
            expr: ('ceil((shmwatch:mount_recommended_size_bytes + clamp_min(max by (instance, job, pod_uid) '
                   + '(shmwatch_cgroup_memory_working_set_bytes) - on (instance, job, pod_uid) group_right () '
                   + 'shmwatch_mount_used_bytes, 0)) / %d) * %d') % [MiB, MiB],
          },
          // In the records' group, not prometheusAlerts: rules of one group are evaluated in
          // order, so the alert always reads this tick's recommendation (two groups race).
          {
            alert: 'ShmRecommendationExceedsMemoryLimit',
            expr: 'shmwatch:mount_recommended_memory_limit_bytes > on (instance, job, pod_uid) group_left () '
                  + 'max by (instance, job, pod_uid) (shmwatch_cgroup_memory_limit_bytes)',
            'for': c.alertFor.ShmRecommendationExceedsMemoryLimit,
            labels: { severity: 'warning' },
            annotations: named({
              summary: 'The memory limit, not the shm size, must grow for {{ $labels.mount }}: to {{ $value | humanize1024 }}B',
              description: oneLine(|||
                The recommended size of {{ $labels.mount }} on {{ $labels.instance }} (highest peak of the last %s
                x %s: shmwatch:mount_recommended_size_bytes) does not fit in what the memory limit leaves besides
                the rest of the pod's working set. tmpfs pages are charged to the pod's memory cgroup, so a larger
                sizeLimit alone would only move the failure from ENOSPC to an OOM kill. Raise the memory limit to
                at least {{ $value | humanize1024 }}B (shmwatch check --recommend prints the exact settings), then
                the shm size.
              ||| % [c.recommendationWindow, num(c.recommendationHeadroom)]),
              runbook_url: c.runbookUrlPrefix + 'shmrecommendationexceedsmemorylimit',
            }),
          },
        ],
      },
    ],
  },
}
