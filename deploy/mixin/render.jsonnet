// What deploy/mixin/render.py writes, by repository path: the mixin with its default
// _config, split the way the repository ships it.
local mixin = import 'mixin.libsonnet';
local node = [g for g in mixin.prometheusRules.groups if g.name == 'shmwatch-node'];
local kube = [g for g in mixin.prometheusRules.groups if g.name == 'shmwatch-kube'];
local isRecommend(g) = g.name == 'shmwatch-recommend';
// The recommendation's records and its alert, in one group (evaluated in that order).
local recommend = [g for g in mixin.prometheusRules.groups if isRecommend(g)];
local rest = [
  g
  for g in mixin.prometheusRules.groups
  if g.name != 'shmwatch-node' && g.name != 'shmwatch-kube' && !isRecommend(g)
];
local alerts = mixin.prometheusAlerts.groups;
{
  // Sidecar and node mode alike: the alerts and the recording rules they use.
  'deploy/prometheus/shmwatch-rules.yml': { groups: rest + alerts },
  // The shm size recommendation and the alert that says the memory limit must grow for it.
  'deploy/prometheus/shmwatch-recommend-rules.yml': { groups: recommend },
  // Node mode only: needs kube-state-metrics' kube_pod_info.
  'deploy/prometheus/shmwatch-node-rules.yml': { groups: node },
  // kube-prometheus: cAdvisor's and kube-state-metrics' series joined with shmwatch's.
  'deploy/prometheus/shmwatch-kube-rules.yml': { groups: kube },
  'grafana/shmwatch.json': mixin.grafanaDashboards['shmwatch.json'],
}
