"""The Grafana dashboard: well-formed, held to the metric catalogue, every panel live."""
import json
import os
import re
import shutil
import subprocess
import time

import pytest
import yaml


from exporter.model.catalogue import BY_NAME
from tests.conftest import REPO, Exporter, Peer, fallocate, mounted_tmpfs, needs_root
from tests.live import Prometheus, fast_rules

DASHBOARD = os.path.join(REPO, "grafana", "shmwatch.json")
# Panels whose source this machine does not have: no GPU, so NVML reports nothing.
# No GPU here; the exporter watches its own cgroup, which has no memory.high on v1 (nor at a v2
# root): the series is checked against real v2 cgroups in tests/vm/test_cgroup_v2_vm.py.
NO_SOURCE_HERE = {"GPU memory used", "GPU memory per GPU", "GPU memory per process", "memory.high and the shm under it"}
FUNCTIONS = {"sum", "by", "max", "min", "rate", "increase", "sort_desc", "clamp_max", "count", "label_values",
             "on", "and", "or", "without", "avg", "group", "group_left", "unless", "query_result"}


def load():
    with open(DASHBOARD) as f:
        return json.load(f)


def panels(d=None):
    return [p for p in (d or load())["panels"] if p["type"] != "row"]


def exprs(d=None):
    return [(p["title"], t["expr"]) for p in panels(d) for t in p["targets"]]


def metric_names(expr):
    cleaned = re.sub(r'"[^"]*"', '""', expr)
    cleaned = re.sub(r"\b(by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", " ", cleaned)  # label lists
    cleaned = re.sub(r"\{[^}]*\}", "{}", cleaned)
    return {n for n in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b", cleaned)
            if n not in FUNCTIONS and not n.startswith("__") and ("_" in n or n == "ALERTS")
            and not re.fullmatch(r"\d+\w*", n)}


def recorded():
    """Series the project's own recording rules make (deploy/prometheus/*.yml)."""
    import glob

    import yaml
    names = set()
    for path in glob.glob(os.path.join(REPO, "deploy", "prometheus", "*rules.yml")):
        with open(path) as f:
            names |= {r["record"] for g in yaml.safe_load(f)["groups"] for r in g["rules"] if "record" in r}
    return names


def test_structure():
    d = load()
    assert d["schemaVersion"] >= 39 and d["uid"] == "shmwatch"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "job", "instance", "namespace", "pod", "mount"} <= names
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert len(rows) == 8
    for p in panels(d):
        assert p["description"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
    # No hard-coded datasource uid anywhere.
    uids = set(re.findall(r'"uid": "([^"]*)"', json.dumps(d)))
    assert uids == {"${datasource}", "shmwatch"}
    gauge = next(p for p in panels(d) if p["title"] == "/dev/shm usage")
    steps = [s["value"] for s in gauge["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, 0.8, 0.95] and gauge["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_every_metric_is_in_the_catalogue():
    d = load()
    used = set()
    for _, expr in exprs(d):
        used |= metric_names(expr)
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            used |= metric_names(v["query"]["query"])
    unknown = sorted(n for n in used - {"ALERTS"} - recorded() if n not in BY_NAME)
    assert not unknown, f"dashboard uses metrics not in exporter/model/catalogue.py nor recorded by our rules: {unknown}"
    assert "shmwatch_top_segment_bytes" in used
    # Every panel draws what shmwatch exports by default: none waits on an opt-in family.
    opt_in = sorted(n for n in used & set(BY_NAME) if not BY_NAME[n].default)
    assert not opt_in, f"panels that need an opt-in family (--metric-opt-in-list): {opt_in}"


def substitute(expr, mount):
    return (expr.replace("$job", "shmwatch").replace("$instance", ".*").replace("$namespace", ".*")
            .replace("$pod", ".*").replace("$mount", mount).replace("$__rate_interval", "1m"))


@needs_root
def test_every_panel_returns_data_from_a_live_prometheus(tmp_path):
    rules = str(tmp_path / "rules.yml")
    fast_rules(rules)
    with mounted_tmpfs("16m") as shm, \
            Peer(shm, "psm", str(1 << 20)), Peer(shm, "hidden", "nccl-dashbd", str(2 << 20)), \
            Peer(shm, "mapped", "torch_1_2", str(1 << 20)), \
            Exporter(f"--shm.mount={shm}", "--no-collector.gpu", "--memory.limit-bytes=16Gi",
                     "--poll-interval=250ms", "--inventory-interval=1s") as exporter:
        with Peer(shm, "leak", str(1 << 20)) as leak:
            leak.proc.wait(10)
        # A crashed engine's leak, written long ago: named in "Largest segments" at once.
        hour_ago = time.time() - 3600
        os.utime(os.path.join(shm, leak.info.lstrip("/")), (hour_ago, hour_ago))
        fallocate(os.path.join(shm, "sem.mp-dash"), 4096)
        fallocate(os.path.join(shm, "psm_filler"), 9 << 20)  # ~88 %: ShmUsageHigh fires, ALERTS has a series
        with Prometheus(str(tmp_path), [f"127.0.0.1:{exporter.port}"], rules=rules) as prom:
            assert prom.wait_query('ALERTS{alertname="ShmUsageHigh", alertstate="firing"}', timeout=30)
            # A create while Prometheus scrapes, so the rate panels (memory events) have two samples.
            fallocate(os.path.join(shm, "psm_late"), 4096)
            prom.wait_query(f'sum(shmwatch_segments{{mount="{shm}", class="python_shm"}}) >= 4', timeout=15)
            empty = []
            for title, expr in exprs():
                result = prom.query(substitute(expr, shm))
                if not result and title not in NO_SOURCE_HERE:
                    empty.append((title, expr))
            for v in load()["templating"]["list"]:
                if v["type"] == "query" and v["name"] in ("job", "instance"):
                    selector = re.match(r"label_values\((.*), \w+\)", v["query"]["query"]).group(1)
                    assert prom.query(substitute(selector, shm)), v["name"]
                if v["name"] == "mount":  # its mounts by path (node mode's pods: by volume)
                    inner = re.fullmatch(r"query_result\((.*)\)", v["query"]["query"]).group(1)
                    found = [r["metric"] for r in prom.query(substitute(inner, shm))]
                    assert found == [{"mount": shm}], found
    assert not empty, f"panels with no data: {empty}"


# Panels that show the worst of several series: which way is worse for each metric. Two
# sidecars' series of known values must give the worse one (a `max` turned `min` shows the
# least-full pod, and the gauge would look fine while one pod is at 90 %).
WORST_OF = {
    ("/dev/shm usage", "shmwatch:mount_usage_ratio"): ("mount", max),
    ("OOM risk (working set / limit)", "shmwatch:oom_risk_ratio"): ("cgroup", max),
    ("OOM risk (working set / limit)", "shmwatch_shm_oom_projection_ratio"): ("mount", max),
    ("Collectors", "shmwatch_collector_success"): ("collector", min),
    ("Collector duration", "shmwatch_collector_duration_seconds"): ("collector", max),
    ("/proc access", "shmwatch_proc_unreadable"): (None, max),
    ("Inventory degraded", "shmwatch_inventory_degraded"): ("mount", max),
}


@pytest.mark.parametrize("title,metric", sorted(WORST_OF))
def test_worst_of_panels_show_the_worst_series(tmp_path, title, metric):
    label, worse = WORST_OF[(title, metric)]
    expr = next(e for t, e in exprs() if t == title and e.split("{")[0].split("((")[-1] == metric)
    values = (0.25, 1.0) if worse is min else (0.25, 0.75)
    series = []
    for instance, value in zip(("a:9841", "b:9841"), values):
        labels = {"job": "shmwatch", "instance": instance, "namespace": "ml", "pod": f"vllm-{instance[0]}",
                  "pod_uid": "", "mount": "/dev/shm", "cgroup": "/", "collector": "segments"}
        text = ", ".join(f'{k}="{v}"' for k, v in labels.items())
        series.append({"series": f"{metric}{{{text}}}", "values": f"{value}x5"})
    out = f'{{{label}="{ {"mount": "/dev/shm", "cgroup": "/", "collector": "segments"}[label] }"}}' if label else "{}"
    tests = {"evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": substitute(expr, ".*"), "eval_time": "4m",
                              "exp_samples": [{"labels": out, "value": worse(values)}]}],
    }]}
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests))
    promtool = shutil.which("promtool") or pytest.fail("promtool not installed (Debian 'prometheus')")
    result = subprocess.run([promtool, "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
