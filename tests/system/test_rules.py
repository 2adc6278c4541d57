"""Alert rules: promtool check, promtool unit tests (a firing and a quiet case per alert),
the metric catalogue, the runbook, and the PrometheusRule copy."""
import os
import re
import shutil
import subprocess

import pytest
import yaml

from exporter.model.catalogue import BY_NAME
from tests.conftest import REPO

RULES = os.path.join(REPO, "deploy", "prometheus", "shmwatch-rules.yml")
RUNBOOK = os.path.join(REPO, "deploy", "prometheus", "runbook.md")
OPERATOR_RULE = os.path.join(REPO, "deploy", "kubernetes", "rules", "prometheusrule.yaml")

L = 'instance="a", job="shmwatch"'
M = L + ', mount="/dev/shm"'
LM = {"instance": "a", "job": "shmwatch", "mount": "/dev/shm"}
LI = {"instance": "a", "job": "shmwatch"}
CG = L + ', cgroup="/kubepods/pod1"'
LCG = {**LI, "cgroup": "/kubepods/pod1"}
GPU = L + ', gpu="0", uuid="GPU-1"'
LGPU = {**LI, "gpu": "0", "uuid": "GPU-1"}
MiB = 1 << 20

# alert: (series for the firing case, series for the quiet case, eval time, labels of the firing alert)
CASES = {
    "ShmUsageHigh": ({f"shmwatch_mount_used_bytes{{{M}}}": "85x10", f"shmwatch_mount_size_bytes{{{M}}}": "100x10"},
                     {f"shmwatch_mount_used_bytes{{{M}}}": "75x10", f"shmwatch_mount_size_bytes{{{M}}}": "100x10"},
                     "10m", LM),
    "ShmUsageCritical": ({f"shmwatch_mount_used_bytes{{{M}}}": "97x10", f"shmwatch_mount_size_bytes{{{M}}}": "100x10"},
                         {f"shmwatch_mount_used_bytes{{{M}}}": "90x10", f"shmwatch_mount_size_bytes{{{M}}}": "100x10"},
                         "10m", LM),
    # 2500 MiB: 1000 free and 20 MiB a minute more used (60 % full and more), or 500 free, steady.
    "ShmFillingUp": ({f"shmwatch_mount_used_bytes{{{M}}}": f"{1500 * MiB}+{20 * MiB}x45",
                      f"shmwatch_mount_size_bytes{{{M}}}": f"{2500 * MiB}x45"},
                     {f"shmwatch_mount_used_bytes{{{M}}}": f"{2000 * MiB}+0x45",
                      f"shmwatch_mount_size_bytes{{{M}}}": f"{2500 * MiB}x45"}, "45m", LM),
    "ShmPeakNearFull": ({f"shmwatch_mount_peak_used_bytes{{{M}}}": "97x5", f"shmwatch_mount_size_bytes{{{M}}}": "100x5",
                         f"shmwatch_mount_used_bytes{{{M}}}": "50x5"},
                        {f"shmwatch_mount_peak_used_bytes{{{M}}}": "90x5", f"shmwatch_mount_size_bytes{{{M}}}": "100x5",
                         f"shmwatch_mount_used_bytes{{{M}}}": "50x5"}, "2m", LM),
    "ShmDockerDefaultSize": ({f"shmwatch_mount_size_bytes{{{M}}}": f"{64 * MiB}x10",
                              f'shmwatch_segments{{{M}, class="nccl", state="linked"}}': "3x10"},
                             {f"shmwatch_mount_size_bytes{{{M}}}": f"{16 << 30}x10",
                              f'shmwatch_segments{{{M}, class="nccl", state="linked"}}': "3x10"}, "10m", LM),
    "ShmLeakedSegments": ({f'shmwatch_segment_bytes{{{M}, class="python_shm", state="orphan"}}': "20x20",
                           f"shmwatch_mount_size_bytes{{{M}}}": "100x20"},
                          {f'shmwatch_segment_bytes{{{M}, class="semaphore", state="orphan"}}': "20x20",
                           f"shmwatch_mount_size_bytes{{{M}}}": "100x20"}, "20m", LM),
    "ShmLeakedSegmentsOld": ({f"shmwatch_orphan_oldest_age_seconds{{{M}}}": "30000x20"},
                             {f"shmwatch_orphan_oldest_age_seconds{{{M}}}": "3600x20"}, "20m", LM),
    "ShmHiddenSegmentsLarge": ({f'shmwatch_segment_bytes{{{M}, class="nccl", state="hidden"}}': "60x40",
                                f"shmwatch_mount_size_bytes{{{M}}}": "100x40"},
                               {f'shmwatch_segment_bytes{{{M}, class="nccl", state="hidden"}}': "30x40",
                                f"shmwatch_mount_size_bytes{{{M}}}": "100x40"}, "40m", LM),
    "ShmMountMissing": ({f"shmwatch_mount_error{{{M}}}": "1x10"}, {f"shmwatch_mount_error{{{M}}}": "0x10"}, "10m",
                        LM),
    "ShmInventoryDegraded": ({f"shmwatch_inventory_degraded{{{M}}}": "1x20"},
                             {f"shmwatch_inventory_degraded{{{M}}}": "0x20"}, "20m", LM),
    "PodOomRiskHigh": ({f"shmwatch_cgroup_memory_working_set_bytes{{{CG}}}": "95x10",
                        f'shmwatch_cgroup_memory_limit_bytes{{{CG}, limit_from="pod"}}': "100x10"},
                       {f"shmwatch_cgroup_memory_working_set_bytes{{{CG}}}": "50x10",
                        f'shmwatch_cgroup_memory_limit_bytes{{{CG}, limit_from="pod"}}': "100x10"}, "10m", LCG),
    "ShmSizeExceedsMemoryLimit": ({f'shmwatch_shm_oom_projection_ratio{{{CG}, mount="/dev/shm"}}': "1.3x20"},
                                  {f'shmwatch_shm_oom_projection_ratio{{{CG}, mount="/dev/shm"}}': "0.8x20"}, "20m",
                                  {**LCG, "mount": "/dev/shm"}),
    "PodOomKilled": ({f"shmwatch_cgroup_oom_kills_total{{{CG}}}": "0 0 0 1 1 1"},
                     {f"shmwatch_cgroup_oom_kills_total{{{CG}}}": "2x10"}, "5m", LCG),
    # Over memory.high all along, shm three quarters of it: firing; the same throttling with
    # little shm (anon memory is the cause, reclaimable): quiet.
    "PodThrottledAtMemoryHigh": ({f"shmwatch_cgroup_memory_shmem_bytes{{{CG}}}": "150x15",
                                  f"shmwatch_cgroup_memory_high_bytes{{{CG}}}": "200x15",
                                  f'shmwatch_cgroup_memory_events_total{{{CG}, event="high"}}': "0+7x15"},
                                 {f"shmwatch_cgroup_memory_shmem_bytes{{{CG}}}": "10x15",
                                  f"shmwatch_cgroup_memory_high_bytes{{{CG}}}": "200x15",
                                  f'shmwatch_cgroup_memory_events_total{{{CG}, event="high"}}': "0+7x15"},
                                 "15m", LCG),
    "HostMemoryLow": ({f"shmwatch_host_memory_available_bytes{{{L}}}": "1x10",
                       f"shmwatch_host_memory_total_bytes{{{L}}}": "20x10"},
                      {f"shmwatch_host_memory_available_bytes{{{L}}}": "10x10",
                       f"shmwatch_host_memory_total_bytes{{{L}}}": "20x10"}, "10m", LI),
    "SysvSegmentsNearLimit": ({f"shmwatch_sysv_segments{{{L}}}": "4000x10", f"shmwatch_sysv_limit_shmmni{{{L}}}": "4096x10"},
                              {f"shmwatch_sysv_segments{{{L}}}": "10x10", f"shmwatch_sysv_limit_shmmni{{{L}}}": "4096x10"},
                              "10m", LI),
    "SysvBytesNearLimit": ({f"shmwatch_sysv_bytes{{{L}}}": "95x10", f"shmwatch_sysv_limit_shmall_bytes{{{L}}}": "100x10"},
                           {f"shmwatch_sysv_bytes{{{L}}}": "10x10", f"shmwatch_sysv_limit_shmall_bytes{{{L}}}": "100x10"},
                           "10m", LI),
    # 92 % is vLLM's normal preallocation (--gpu-memory-utilization 0.9): quiet.
    "GpuMemoryNearlyFull": ({f"shmwatch_gpu_memory_used_bytes{{{GPU}}}": "79.5x15",
                             f"shmwatch_gpu_memory_total_bytes{{{GPU}}}": "80x15"},
                            {f"shmwatch_gpu_memory_used_bytes{{{GPU}}}": "73.6x15",
                             f"shmwatch_gpu_memory_total_bytes{{{GPU}}}": "80x15"}, "15m", LGPU),
    "ShmwatchDown": ({f"up{{{L}}}": "0x10"}, {f"up{{{L}}}": "1x10"}, "10m", LI),
    "ShmwatchCollectorFailing": ({f'shmwatch_collector_success{{{L}, collector="segments"}}': "0x15"},
                                 {f'shmwatch_collector_success{{{L}, collector="gpu"}}': "0x15"}, "15m",
                                 {**LI, "collector": "segments"}),
    # GPUs were seen, then NVML failed, and they stay gone for three hours: still firing (a
    # look-back window of an hour would have let it resolve). A CPU-only node (never a GPU): quiet.
    "ShmwatchGpuCollectorFailing": ({f'shmwatch_collector_success{{{L}, collector="gpu"}}': "1x10 0x200",
                                     f'shmwatch_gpu_info{{{GPU}, name="H100", driver_version="550"}}': "1x10 _x200"},
                                    {f'shmwatch_collector_success{{{L}, collector="gpu"}}': "0x200"}, "3h",
                                    {**LI, "collector": "gpu"}),
}


def load_rules():
    with open(RULES) as f:
        return yaml.safe_load(f)


def alerts():
    return [r for g in load_rules()["groups"] for r in g["rules"] if "alert" in r]


def promtool():
    return shutil.which("promtool") or pytest.fail("promtool not installed (Debian 'prometheus')")


def test_promtool_check_rules_is_clean():
    result = subprocess.run([promtool(), "check", "rules", RULES], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "WARNING" not in (result.stdout + result.stderr).upper()


def test_every_alert_has_cases_severity_annotations_and_runbook():
    with open(RUNBOOK) as f:
        headings = {line[3:].strip().lower() for line in f if line.startswith("## ")}
    names = [a["alert"] for a in alerts()]
    assert sorted(names) == sorted(CASES), "every alert needs a firing and a quiet case in CASES"
    groups = {g["name"] for g in load_rules()["groups"]}
    assert {"shmwatch-shm", "shmwatch-memory", "shmwatch-sysv", "shmwatch-gpu", "shmwatch-exporter"} <= groups
    for a in alerts():
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        ann = a["annotations"]
        # The current value in the description, unless the expression is a 0/1 state.
        is_state = re.search(r"== [01](\s|$)", a["expr"]) is not None
        assert ann["summary"] and ("$value" in ann["description"] or is_state), a["alert"]
        anchor = ann["runbook_url"].rsplit("#", 1)[1]
        assert anchor == a["alert"].lower() and anchor in headings, f"{a['alert']}: runbook section missing"


def metric_names(expr):
    """Metric names in a PromQL expression (label lists, strings and functions removed)."""
    cleaned = re.sub(r'"[^"]*"', '""', expr)
    cleaned = re.sub(r"\b(by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", " ", cleaned)
    cleaned = re.sub(r"\{[^}]*\}", " ", cleaned)
    cleaned = re.sub(r"\[[^\]]*\]", " ", cleaned)
    words = {m.group(1) for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)", cleaned)
             if not cleaned[m.end():].lstrip().startswith("(")}  # a name followed by "(" is a function
    keywords = {"and", "or", "unless", "by", "on", "without", "ignoring", "group_left", "group_right", "bool"}
    return {w for w in words if w not in keywords}


def test_every_metric_in_the_rules_is_in_the_catalogue():
    used = set()
    rules = [r for g in load_rules()["groups"] for r in g["rules"]]
    for r in rules:
        used |= metric_names(r["expr"])
    assert "shmwatch_mount_used_bytes" in used and "shmwatch_cgroup_oom_kills_total" in used
    recorded = {r["record"] for r in rules if "record" in r}
    unknown = sorted(n for n in used - recorded if n != "up" and n not in BY_NAME)
    assert not unknown, f"rules use metrics that are not in exporter/model/catalogue.py: {unknown}"


def unit_tests_yaml(rules_file):
    tests = []
    for alert, (firing, quiet, at, labels) in CASES.items():
        for series, expected in ((firing, [{"exp_labels": {**labels, "severity": severity(alert)}}]), (quiet, [])):
            tests.append({
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": expected}],
            })
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


def severity(alert):
    return next(a["labels"]["severity"] for a in alerts() if a["alert"] == alert)


def test_promtool_unit_tests(tmp_path):
    # promtool compares annotations too; they are checked rendered in the live test
    # (tests/system/test_alerting_live.py). Here: the firing logic, on a copy without them.
    rules = load_rules()
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(unit_tests_yaml(str(tmp_path / "rules.yml"))))
    result = subprocess.run([promtool(), "test", "rules", str(tmp_path / "tests.yml")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "SUCCESS" in result.stdout


def promtool_test(tmp_path, test):
    """One promtool unit test against the rules (annotations left out: checked rendered in
    tests/system/test_alerting_live.py)."""
    rules = load_rules()
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(
        {"rule_files": [str(tmp_path / "rules.yml")], "evaluation_interval": "1m", "tests": [test]}))
    result = subprocess.run([promtool(), "test", "rules", str(tmp_path / "tests.yml")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_gpu_collector_failing_fires_for_as_long_as_the_gpu_is_gone(tmp_path):
    """Seen for 10 minutes, then NVML fails for three hours, then answers again."""
    firing = [{"exp_labels": {**LI, "collector": "gpu", "severity": "warning"}}]
    test = {"interval": "1m", "input_series": [
        {"series": f'shmwatch_collector_success{{{L}, collector="gpu"}}', "values": "1x10 0x180 1x20"},
        {"series": f'shmwatch_gpu_info{{{GPU}, name="H100", driver_version="550"}}', "values": "1x10 _x200"},
        # Another exporter that never had a GPU: its latch stays empty.
        {"series": 'shmwatch_collector_success{instance="b", job="shmwatch", collector="gpu"}', "values": "0x210"},
    ], "alert_rule_test": [
        {"eval_time": "5m", "alertname": "ShmwatchGpuCollectorFailing", "exp_alerts": []},
        {"eval_time": "30m", "alertname": "ShmwatchGpuCollectorFailing", "exp_alerts": firing},
        {"eval_time": "75m", "alertname": "ShmwatchGpuCollectorFailing", "exp_alerts": firing},
        {"eval_time": "3h", "alertname": "ShmwatchGpuCollectorFailing", "exp_alerts": firing},
        {"eval_time": "3h25m", "alertname": "ShmwatchGpuCollectorFailing", "exp_alerts": []},
    ]}
    promtool_test(tmp_path, test)


def test_prometheusrule_carries_the_same_groups():
    with open(OPERATOR_RULE) as f:
        manifest = yaml.safe_load(f)
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1" and manifest["kind"] == "PrometheusRule"
    assert manifest["spec"] == load_rules(), "regenerate: python3 deploy/mixin/render.py"


NODE_RULES = os.path.join(REPO, "deploy", "prometheus", "shmwatch-node-rules.yml")
NODE_OPERATOR_RULE = os.path.join(REPO, "deploy", "kubernetes", "daemonset", "node-recording-rules.yaml")


def test_node_recording_rules_join_pod_names(tmp_path):
    result = subprocess.run([promtool(), "check", "rules", NODE_RULES], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    pod = 'instance="n1", job="shmwatch-node", pod_uid="u1", volume="dshm"'
    host = 'instance="n1", job="shmwatch-node", mount="/dev/shm"'
    tests = {"rule_files": [NODE_RULES], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": f"shmwatch_mount_used_bytes{{{pod}}}", "values": "50x5"},
            {"series": f"shmwatch_mount_size_bytes{{{pod}}}", "values": "100x5"},
            {"series": f"shmwatch_mount_used_bytes{{{host}}}", "values": "10x5"},
            {"series": f"shmwatch_mount_size_bytes{{{host}}}", "values": "100x5"},
            {"series": 'kube_pod_info{namespace="ml", pod="vllm-0", uid="u1", node="n1", job="ksm"}',
             "values": "1x5"},
        ],
        "promql_expr_test": [{
            "expr": "shmwatch:pod_mount_usage_ratio", "eval_time": "5m",
            "exp_samples": [{"labels": f'shmwatch:pod_mount_usage_ratio{{{pod}, namespace="ml", pod="vllm-0"}}',
                             "value": 0.5}],
        }],
    }]}
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool(), "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(NODE_RULES) as f:
        rules = yaml.safe_load(f)
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"]}
    for g in rules["groups"]:
        for r in g["rules"]:
            unknown = {n for n in metric_names(r["expr"]) - recorded - {"kube_pod_info"} if n not in BY_NAME}
            assert not unknown, f"{r['record']}: {unknown}"
    with open(NODE_OPERATOR_RULE) as f:
        manifest = next(d for d in yaml.safe_load_all(f) if d)
    assert manifest["spec"] == rules, "regenerate: python3 deploy/mixin/render.py"


KUBE_RULES = os.path.join(REPO, "deploy", "prometheus", "shmwatch-kube-rules.yml")
KUBE_OPERATOR_RULE = os.path.join(REPO, "deploy", "kubernetes", "rules", "kube-recording-rules.yaml")


def test_kube_prometheus_rules_join_cadvisor_ksm_and_the_sidecar(tmp_path):
    """A vLLM pod (vllm 300 MiB working set of 512 MiB, the shmwatch sidecar 20 of 96) whose
    /dev/shm (1 GiB) holds 200 MiB: risk 320/608, projection (320 - 200 + 1024)/608. The
    pod-level cgroup series (container="") and the pause container (image="") are not
    counted twice. A pod with an unlimited container has no limit, so no ratio."""
    result = subprocess.run([promtool(), "check", "rules", KUBE_RULES], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    cad = 'job="kubelet", metrics_path="/metrics/cadvisor"'
    ksm = 'job="kube-state-metrics"'
    sidecar = 'job="ml/shmwatch", instance="10.0.0.7:9841", container="shmwatch", mount="/dev/shm"'
    series = {
        f'container_memory_working_set_bytes{{{cad}, namespace="ml", pod="vllm-0", container="vllm", image="v"}}': 300,
        f'container_memory_working_set_bytes{{{cad}, namespace="ml", pod="vllm-0", container="shmwatch", '
        f'image="s"}}': 20,
        f'container_memory_working_set_bytes{{{cad}, namespace="ml", pod="vllm-0", container="", image=""}}': 321,
        f'container_memory_working_set_bytes{{{cad}, namespace="ml", pod="vllm-0", container="POD", image=""}}': 1,
        f'kube_pod_container_resource_limits{{{ksm}, namespace="ml", pod="vllm-0", container="vllm", '
        f'resource="memory", unit="byte"}}': 512,
        f'kube_pod_container_resource_limits{{{ksm}, namespace="ml", pod="vllm-0", container="shmwatch", '
        f'resource="memory", unit="byte"}}': 96,
        f'kube_pod_container_info{{{ksm}, namespace="ml", pod="vllm-0", container="vllm"}}': 1 / MiB,
        f'kube_pod_container_info{{{ksm}, namespace="ml", pod="vllm-0", container="shmwatch"}}': 1 / MiB,
        f'shmwatch_mount_used_bytes{{{sidecar}, namespace="ml", pod="vllm-0"}}': 200,
        f'shmwatch_mount_size_bytes{{{sidecar}, namespace="ml", pod="vllm-0"}}': 1024,
        # A second pod: one of its two containers has no memory limit.
        f'container_memory_working_set_bytes{{{cad}, namespace="ml", pod="open-0", container="a", image="a"}}': 10,
        f'kube_pod_container_resource_limits{{{ksm}, namespace="ml", pod="open-0", container="a", '
        f'resource="memory", unit="byte"}}': 64,
        f'kube_pod_container_info{{{ksm}, namespace="ml", pod="open-0", container="a"}}': 1 / MiB,
        f'kube_pod_container_info{{{ksm}, namespace="ml", pod="open-0", container="b"}}': 1 / MiB,
        f'shmwatch_mount_used_bytes{{{sidecar}, namespace="ml", pod="open-0"}}': 1,
        f'shmwatch_mount_size_bytes{{{sidecar}, namespace="ml", pod="open-0"}}': 64,
    }
    pod = 'namespace="ml", pod="vllm-0"'
    tests = {"rule_files": [KUBE_RULES], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": k, "values": f"{v * MiB:.0f}x5"} for k, v in series.items()],
        "promql_expr_test": [
            {"expr": "shmwatch:kube_pod_memory_working_set_bytes", "eval_time": "5m",
             "exp_samples": [{"labels": f"shmwatch:kube_pod_memory_working_set_bytes{{{pod}}}", "value": 320 * MiB},
                             {"labels": 'shmwatch:kube_pod_memory_working_set_bytes{namespace="ml", pod="open-0"}',
                              "value": 10 * MiB}]},
            {"expr": "shmwatch:kube_pod_oom_risk_ratio", "eval_time": "5m",
             "exp_samples": [{"labels": f"shmwatch:kube_pod_oom_risk_ratio{{{pod}}}", "value": 320 / 608}]},
            {"expr": "shmwatch:kube_pod_shm_oom_projection_ratio", "eval_time": "5m",
             "exp_samples": [{"labels": f'shmwatch:kube_pod_shm_oom_projection_ratio{{{pod}, mount="/dev/shm"}}',
                              "value": (320 - 200 + 1024) / 608}]},
        ],
    }]}
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool(), "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(KUBE_RULES) as f:
        rules = yaml.safe_load(f)
    with open(KUBE_OPERATOR_RULE) as f:
        manifest = next(d for d in yaml.safe_load_all(f) if d)
    assert manifest["spec"] == rules, "regenerate: python3 deploy/mixin/render.py"


def test_a_pod_throttled_at_its_containers_memory_high_fires_against_its_limit(tmp_path):
    """Node mode reads the pod's cgroup, which has no memory.high (MemoryQoS sets the
    containers'); its memory.events counts theirs. Shm over half the pod's limit: firing."""
    pod = f'{L}, cgroup="/kubepods/burstable/podA"'
    firing = [{"exp_labels": {**LI, "cgroup": "/kubepods/burstable/podA", "severity": "warning"}}]
    test = {"interval": "1m", "input_series": [
        {"series": f"shmwatch_cgroup_memory_shmem_bytes{{{pod}}}", "values": "300x20"},
        {"series": f'shmwatch_cgroup_memory_limit_bytes{{{pod}, limit_from="self"}}', "values": "512x20"},
        {"series": f'shmwatch_cgroup_memory_events_total{{{pod}, event="high"}}', "values": "0+5x20"},
    ], "alert_rule_test": [{"eval_time": "20m", "alertname": "PodThrottledAtMemoryHigh", "exp_alerts": firing}]}
    promtool_test(tmp_path, test)


def test_every_rule_reads_only_what_shmwatch_exports_by_default():
    """Every alert and recording rule of every shipped rule file fires and records from the
    default set (exporter/model/catalogue.py): no rule waits on an opt-in family."""
    from exporter.model.catalogue import DEFAULT_SET
    from tests.rules.promql import metric_names as parsed_names, parse
    from tests.rules.promtool import load_groups, rule_paths, rules_of

    rules = rules_of(load_groups(rule_paths()))
    read = {n for r in rules.values() for n in parsed_names(parse(r["expr"])) if n.startswith("shmwatch_")}
    assert {"shmwatch_mount_used_bytes", "shmwatch_cgroup_memory_working_set_bytes"} <= read
    assert sorted(read - DEFAULT_SET) == []


def test_the_catalogue_lists_exactly_the_families_the_rules_and_dashboard_read():
    """READ_BY_RULES_AND_DASHBOARD is what start-up warns of when an allow- or denylist
    leaves one out: it must be what the shipped rules and dashboard read, no more, no less."""
    from exporter.model.catalogue import BY_NAME, READ_BY_RULES_AND_DASHBOARD
    from tests.rules.promql import metric_names as parsed_names, parse
    from tests.rules.promtool import load_groups, rule_paths, rules_of
    from tests.system.test_dashboard import exprs, load, metric_names

    rules = rules_of(load_groups(rule_paths()))
    read = {n for r in rules.values() for n in parsed_names(parse(r["expr"]))}
    board = load()
    for _, expr in exprs(board):
        read |= metric_names(expr)
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            read |= metric_names(v["query"]["query"])
    assert sorted(read & set(BY_NAME)) == sorted(READ_BY_RULES_AND_DASHBOARD)


def test_alert_texts_name_a_node_mode_mount_by_its_pod_and_volume(tmp_path):
    """In node mode a pod's mount has no `mount` label (its pod_uid and volume say which it
    is), a runtime's sandbox shm its container_id, a pod's cgroup its pod_uid: the texts say
    those instead of an empty name. (Each alert's summary only, as Alertmanager shows it.)"""
    rules = load_rules()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "annotations" in rule:
                rule["annotations"] = {"summary": rule["annotations"]["summary"]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    pod = 'instance="n", job="shmwatch-node", pod_uid="u1", volume="dshm"'
    sandbox = 'instance="n", job="shmwatch-node", container_id="c0ffee"'
    host = 'instance="n", job="shmwatch-node", mount="/dev/shm"'
    series = [{"series": f"shmwatch_mount_{what}_bytes{{{labels}}}", "values": f"{value}x10"}
              for labels in (pod, sandbox, host) for what, value in (("used", 86), ("size", 100))]
    series.append({"series": 'shmwatch_cgroup_memory_working_set_bytes{instance="n", job="shmwatch-node", '
                             'pod_uid="u1"}', "values": "95x10"})
    series.append({"series": 'shmwatch_cgroup_memory_limit_bytes{instance="n", job="shmwatch-node", pod_uid="u1", '
                             'limit_from="pod"}', "values": "100x10"})
    node = {"instance": "n", "job": "shmwatch-node", "severity": "warning"}
    usage = [
        {"exp_labels": {**node, "pod_uid": "u1", "volume": "dshm"},
         "exp_annotations": {"summary": "volume dshm of pod u1 is 86% full"}},
        {"exp_labels": {**node, "container_id": "c0ffee"},
         "exp_annotations": {"summary": "the shm of container c0ffee is 86% full"}},
        {"exp_labels": {**node, "mount": "/dev/shm"}, "exp_annotations": {"summary": "/dev/shm is 86% full"}},
    ]
    risk = [{"exp_labels": {**node, "pod_uid": "u1"},
             "exp_annotations": {"summary": "Working set is 95% of the memory limit"}}]
    test = {"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": "10m", "alertname": "ShmUsageHigh", "exp_alerts": usage},
        {"eval_time": "10m", "alertname": "PodOomRiskHigh", "exp_alerts": risk},
    ]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(
        {"rule_files": [str(tmp_path / "rules.yml")], "evaluation_interval": "1m", "tests": [test]}))
    result = subprocess.run([promtool(), "test", "rules", str(tmp_path / "tests.yml")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
