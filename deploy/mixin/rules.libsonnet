// Recording rules.
{
  prometheusRules+:: {
    local c = $._config,
    groups+: [
      {
        name: 'shmwatch-gpu-seen',
        rules: [
          // A latch: {instance, job} that ever reported a GPU, kept for as long as the exporter
          // still reports its gpu collector. ShmwatchGpuCollectorFailing needs it to keep firing
          // when a GPU is gone for good (max_over_time(shmwatch_gpu_info[1h]) forgot it after an
          // hour). last_over_time of its own output bridges gaps up to an hour (a Prometheus
          // restart); --no-collector.gpu drops the success series, and with it the latch.
          {
            record: 'shmwatch:gpus_seen',
            expr: |||
              count by (instance, job) (shmwatch_gpu_info)
              or (last_over_time(shmwatch:gpus_seen[1h])
                  and on (instance, job) shmwatch_collector_success{collector="gpu"})
            |||,
          },
        ],
      },
      // Node mode (the DaemonSet): shmwatch knows a pod by its UID (pod_uid, from the
      // kubelet's volume path and the pod's cgroup); kube-state-metrics' kube_pod_info knows
      // its namespace and name (label uid). These join the two.
      {
        name: 'shmwatch-node',
        rules: [
          {
            record: 'shmwatch:pod_info',
            expr: 'max by (pod_uid, namespace, pod) (label_replace(kube_pod_info{uid!=""}, "pod_uid", "$1", "uid", "(.+)"))',
          },
          {
            record: 'shmwatch:pod_mount_usage_ratio',
            expr: 'shmwatch_mount_usage_ratio{pod_uid!=""} * on (pod_uid) group_left (namespace, pod) shmwatch:pod_info',
          },
          {
            record: 'shmwatch:pod_mount_used_bytes',
            expr: 'shmwatch_mount_used_bytes{pod_uid!=""} * on (pod_uid) group_left (namespace, pod) shmwatch:pod_info',
          },
          {
            record: 'shmwatch:pod_segment_bytes',
            expr: 'sum by (pod_uid, mount, volume, class, state) (shmwatch_segment_bytes{pod_uid!=""})'
                  + ' * on (pod_uid) group_left (namespace, pod) shmwatch:pod_info',
          },
          {
            record: 'shmwatch:pod_oom_risk_ratio',
            expr: 'shmwatch_oom_risk_ratio{pod_uid!=""} * on (pod_uid) group_left (namespace, pod) shmwatch:pod_info',
          },
          {
            record: 'shmwatch:pod_shm_oom_projection_ratio',
            expr: 'shmwatch_shm_oom_projection_ratio{pod_uid!=""}'
                  + ' * on (pod_uid) group_left (namespace, pod) shmwatch:pod_info',
          },
        ],
      },
    ],
  },
}
