"""The monitoring mixin (deploy/mixin): the shipped rules, PrometheusRules and dashboard are
its rendering, its _config drives the thresholds, promtool accepts what it renders."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO

MIXIN = os.path.join(REPO, "deploy", "mixin")


def jsonnet():
    return shutil.which("jsonnet") or pytest.fail("jsonnet not installed (Debian 'jsonnet'; .ci/run installs it)")


def promtool():
    return shutil.which("promtool") or pytest.fail("promtool not installed (Debian 'prometheus')")


def render_module():
    spec = importlib.util.spec_from_file_location("mixin_render", os.path.join(MIXIN, "render.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def evaluate(snippet):
    return render_module().evaluate(jsonnet(), snippet)


def all_rules(mixin):
    return {r.get("alert") or r["record"]: r
            for part in ("prometheusAlerts", "prometheusRules") for g in mixin[part]["groups"] for r in g["rules"]}


def test_committed_files_are_the_rendered_mixin(tmp_path):
    render = render_module()
    result = subprocess.run([sys.executable, os.path.join(MIXIN, "render.py"), str(tmp_path)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    paths = sorted(render.files(render.evaluate(jsonnet())))
    assert "grafana/shmwatch.json" in paths and "deploy/kubernetes/rules/prometheusrule.yaml" in paths
    stale = [p for p in paths if (tmp_path / p).read_text() != open(os.path.join(REPO, p)).read()]
    assert not stale, f"{stale} differ from the mixin: run python3 deploy/mixin/render.py"


SNIPPET = "local m = (import 'mixin.libsonnet') + { _config+:: %s };" \
          " { prometheusAlerts: m.prometheusAlerts, prometheusRules: m.prometheusRules," \
          " grafanaDashboards: m.grafanaDashboards }"


def test_config_overrides_reach_alerts_and_dashboard(tmp_path):
    default = evaluate(SNIPPET % "{}")
    tuned = evaluate(SNIPPET % "{ shmUsageWarningRatio: 0.7, shmUsageCriticalRatio: 0.9, "
                               "shmwatchSelector: 'job=\"my-shm\"', alertFor+: { ShmUsageHigh: '2m' } }")
    before, after = all_rules(default), all_rules(tuned)
    usage = "shmwatch_mount_used_bytes / shmwatch_mount_size_bytes"
    assert before["ShmUsageHigh"]["expr"] == f"{usage} > 0.8"
    assert after["ShmUsageHigh"]["expr"] == f"{usage} > 0.7"
    assert after["ShmUsageCritical"]["expr"] == f"{usage} > 0.9"
    assert f"> 0.9 and {usage} <= 0.9" in after["ShmPeakNearFull"]["expr"]
    assert after["ShmwatchDown"]["expr"] == 'up{job="my-shm"} == 0'
    assert after["ShmUsageHigh"]["for"] == "2m" and after["ShmUsageCritical"]["for"] == "1m"
    # Nothing else moved.
    changed = {name for name in before if before[name] != after[name]}
    # (shmwatchSelector also picks the sidecar's mount series in the kube-prometheus join.)
    assert changed == {"ShmUsageHigh", "ShmUsageCritical", "ShmPeakNearFull", "ShmwatchDown",
                       "shmwatch:kube_pod_shm_oom_projection_ratio"}
    # The dashboard's gauge follows the alert thresholds.
    for mixin, steps in ((default, [None, 0.8, 0.95]), (tuned, [None, 0.7, 0.9])):
        gauge = next(p for p in mixin["grafanaDashboards"]["shmwatch.json"]["panels"] if p["title"] == "/dev/shm usage")
        assert [s["value"] for s in gauge["fieldConfig"]["defaults"]["thresholds"]["steps"]] == steps
    # promtool accepts the tuned rendering too.
    path = tmp_path / "tuned.yml"
    path.write_text(yaml.safe_dump({"groups": tuned["prometheusRules"]["groups"]
                                    + tuned["prometheusAlerts"]["groups"]}))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_rendered_defaults_equal_the_repository_files():
    rendered = render_module().evaluate(jsonnet())
    for path in ("deploy/prometheus/shmwatch-rules.yml", "deploy/prometheus/shmwatch-node-rules.yml"):
        with open(os.path.join(REPO, path)) as f:
            assert yaml.safe_load(f) == rendered[path], path
        result = subprocess.run([promtool(), "check", "rules", os.path.join(REPO, path)], capture_output=True,
                                text=True)
        assert result.returncode == 0, result.stdout + result.stderr
    with open(os.path.join(REPO, "grafana", "shmwatch.json")) as f:
        dashboard = json.load(f)
    assert dashboard == rendered["grafana/shmwatch.json"]
    assert len([p for p in dashboard["panels"] if p["type"] != "row"]) >= 20


def test_no_threshold_literal_left_in_alert_expressions():
    """Every number an alert compares against comes from _config: doubling every ratio in
    _config must change every alert that compares to a ratio."""
    default = all_rules(evaluate(SNIPPET % "{}"))
    ratios = ("shmUsageWarningRatio", "shmUsageCriticalRatio", "shmFillingUpMinUsageRatio", "shmLeakedRatio",
              "shmHiddenRatio", "oomRiskRatio", "shmOomProjectionRatio", "hostMemoryAvailableRatio",
              "sysvNearLimitRatio", "gpuMemoryUsedRatio", "memoryHighShmRatio")
    tuned = all_rules(evaluate(SNIPPET % ("{ %s, orphanMaxAgeSeconds: 7, shmDockerDefaultSizeBytes: 9 }"
                                          % ", ".join(f"{r}: 0.123" for r in ratios))))
    unchanged = {name for name, rule in default.items() if "alert" in rule and rule["expr"] == tuned[name]["expr"]}
    # These compare a state or a count to 0/1, or one series to another, not a threshold.
    assert unchanged == {"ShmMountMissing", "ShmInventoryDegraded", "PodOomKilled", "ShmwatchDown", "ShmwatchCollectorFailing",
                         "ShmwatchGpuCollectorFailing", "ShmRecommendationExceedsMemoryLimit"}


def test_mixin_is_jsonnetfmt_clean():
    fmt = shutil.which("jsonnetfmt") or pytest.fail("jsonnetfmt not installed (Debian 'jsonnet')")
    sources = sorted(f for f in os.listdir(MIXIN) if f.endswith((".jsonnet", ".libsonnet")))
    assert "mixin.libsonnet" in sources
    unformatted = [f for f in sources if subprocess.run([fmt, "--test", os.path.join(MIXIN, f)]).returncode != 0]
    assert not unformatted, f"run: jsonnetfmt -i deploy/mixin/{{{','.join(unformatted)}}}"


def leak_alert_classes(expr):
    """The classes ShmLeakedSegments' expression selects: its one class=~"a|b" matcher."""
    [alternatives] = re.findall(r'class=~"([^"]*)"', expr)
    return set(alternatives.split("|"))


def shipped_alert_rules(path):
    """{alert: rule} of a shipped rules file or PrometheusRule."""
    with open(os.path.join(REPO, path)) as f:
        doc = yaml.safe_load(f)
    groups = doc["spec"]["groups"] if doc.get("kind") == "PrometheusRule" else doc["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_leak_alert_classes_are_the_removable_ones():
    """ShmLeakedSegments fires for what `shmwatch check` would advise removing, nothing else:
    in the mixin's rendering and in every file shipped with it."""
    from exporter.model.classes import REMOVABLE
    rendered = evaluate(SNIPPET % "{}")
    assert leak_alert_classes(all_rules(rendered)["ShmLeakedSegments"]["expr"]) == set(REMOVABLE)
    for path in ("deploy/prometheus/shmwatch-rules.yml", "deploy/kubernetes/rules/prometheusrule.yaml"):
        assert leak_alert_classes(shipped_alert_rules(path)["ShmLeakedSegments"]["expr"]) == set(REMOVABLE), path
