// What deploy/mixin/render.py writes, by repository path: the mixin with its default
// _config, split the way the repository ships it.
local mixin = import 'mixin.libsonnet';
local node = [g for g in mixin.prometheusRules.groups if g.name == 'shmwatch-node'];
local kube = [g for g in mixin.prometheusRules.groups if g.name == 'shmwatch-kube'];
local rest = [g for g in mixin.prometheusRules.groups if g.name != 'shmwatch-node' && g.name != 'shmwatch-kube'];
{
  // Sidecar and node mode alike: the alerts and the recording rules they use.
  'deploy/prometheus/shmwatch-rules.yml': { groups: rest + mixin.prometheusAlerts.groups },
  // Node mode only: needs kube-state-metrics' kube_pod_info.
  'deploy/prometheus/shmwatch-node-rules.yml': { groups: node },
  // kube-prometheus: cAdvisor's and kube-state-metrics' series joined with shmwatch's.
  'deploy/prometheus/shmwatch-kube-rules.yml': { groups: kube },
  'grafana/shmwatch.json': mixin.grafanaDashboards['shmwatch.json'],
}
