// What deploy/mixin/render.py writes, by repository path: the mixin with its default
// _config, split the way the repository ships it.
local mixin = import 'mixin.libsonnet';
local node = [g for g in mixin.prometheusRules.groups if g.name == 'shmwatch-node'];
local rest = [g for g in mixin.prometheusRules.groups if g.name != 'shmwatch-node'];
{
  // Sidecar and node mode alike: the alerts and the recording rules they use.
  'deploy/prometheus/shmwatch-rules.yml': { groups: rest + mixin.prometheusAlerts.groups },
  // Node mode only: needs kube-state-metrics' kube_pod_info.
  'deploy/prometheus/shmwatch-node-rules.yml': { groups: node },
  'grafana/shmwatch.json': mixin.grafanaDashboards['shmwatch.json'],
}
