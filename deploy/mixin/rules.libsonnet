// Recording rules.
{
  prometheusRules+:: {
    local c = $._config,
    groups+: [
      // Ratios shmwatch leaves to Prometheus (out of its default set: each is two series it
      // exports already, divided), for dashboards and your own rules. The alerts divide for
      // themselves, so they hold without these.
      {
        name: 'shmwatch-ratios',
        rules: [
          {
            record: 'shmwatch:mount_usage_ratio',
            expr: 'shmwatch_mount_used_bytes / shmwatch_mount_size_bytes',
          },
          {
            record: 'shmwatch:oom_risk_ratio',
            expr: 'shmwatch_cgroup_memory_working_set_bytes / ignoring (limit_from) shmwatch_cgroup_memory_limit_bytes',
          },
        ],
      },
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
      // kube-prometheus users: the pod's exact working set (cAdvisor) and memory limit
      // (kube-state-metrics), joined with a sidecar's mount series by the namespace and pod
      // labels its PodMonitor adds, into the OOM-risk and projection ratios shmwatch itself
      // can only estimate from inside the pod. The pod is what tmpfs pages are charged to:
      // its containers' working sets and limits, summed (a pod with an unlimited container
      // has no limit, and no ratio).
      {
        name: 'shmwatch-kube',
        rules: [
          {
            record: 'shmwatch:kube_pod_memory_working_set_bytes',
            expr: 'sum by (namespace, pod) (container_memory_working_set_bytes{%s, container!="", image!=""})'
                  % c.cadvisorSelector,
          },
          {
            record: 'shmwatch:kube_pod_memory_limit_bytes',
            expr: |||
              sum by (namespace, pod) (kube_pod_container_resource_limits{%(ksm)s, resource="memory"})
              unless on (namespace, pod)
                (count by (namespace, pod) (kube_pod_container_info{%(ksm)s})
                 > count by (namespace, pod) (kube_pod_container_resource_limits{%(ksm)s, resource="memory"}))
            ||| % { ksm: c.kubeStateMetricsSelector },
          },
          {
            record: 'shmwatch:kube_pod_oom_risk_ratio',
            expr: 'shmwatch:kube_pod_memory_working_set_bytes / on (namespace, pod) shmwatch:kube_pod_memory_limit_bytes',
          },
          {
            // (working set - shm used + shm size) / limit, per mount, as shmwatch_shm_oom_projection_ratio.
            // A sidecar's mounts only (no pod_uid, no container_id): a PodMonitor gives a
            // DaemonSet's series its own pod's namespace and pod too, and its pods' mounts
            // have no `mount` label, so they would all fold into one series of that pod.
            record: 'shmwatch:kube_pod_shm_oom_projection_ratio',
            expr: |||
              (
                clamp_min(
                  shmwatch:kube_pod_memory_working_set_bytes
                  - on (namespace, pod) group_right
                    max by (namespace, pod, mount) (
                      shmwatch_mount_used_bytes{%(sidecar)s}
                    ),
                  0)
                + on (namespace, pod, mount)
                  max by (namespace, pod, mount) (
                    shmwatch_mount_size_bytes{%(sidecar)s}
                  )
              )
              / on (namespace, pod) group_left shmwatch:kube_pod_memory_limit_bytes
            ||| % { sidecar: c.shmwatchSelector + ', namespace!="", pod!="", pod_uid="", container_id=""' },
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
            expr: 'shmwatch_mount_used_bytes{pod_uid!=""} / shmwatch_mount_size_bytes'
                  + ' * on (pod_uid) group_left (namespace, pod) shmwatch:pod_info',
          },
          {
            record: 'shmwatch:pod_mount_used_bytes',
            expr: 'shmwatch_mount_used_bytes{pod_uid!=""} * on (pod_uid) group_left (namespace, pod) shmwatch:pod_info',
          },
          {
            // One series per pod, volume, class and state: two exporters that report the same
            // pod (a second DaemonSet, a canary) report the same segments, not more of them.
            record: 'shmwatch:pod_segment_bytes',
            expr: 'max by (pod_uid, volume, class, state) (shmwatch_segment_bytes{pod_uid!=""})'
                  + ' * on (pod_uid) group_left (namespace, pod) shmwatch:pod_info',
          },
          {
            record: 'shmwatch:pod_oom_risk_ratio',
            expr: 'shmwatch_cgroup_memory_working_set_bytes{pod_uid!=""} / ignoring (limit_from) shmwatch_cgroup_memory_limit_bytes'
                  + ' * on (pod_uid) group_left (namespace, pod) shmwatch:pod_info',
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
