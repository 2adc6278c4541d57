// The shmwatch monitoring mixin: alerts, recording rules and the dashboard, from one
// _config (config.libsonnet). deploy/mixin/render.py writes the repository's rule files,
// PrometheusRules and grafana/shmwatch.json from it; tests/project/test_mixin.py fails when they
// differ.
(import 'config.libsonnet') +
(import 'alerts.libsonnet') +
(import 'rules.libsonnet') +
(import 'recommend.libsonnet') +
(import 'dashboards.libsonnet')
