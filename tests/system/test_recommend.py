"""Right-sizing the shm volume (issue 19): the high-water mark on a real tmpfs, the recording
rules (promtool), the rules and the Python formula agreeing, and `shmwatch check --recommend`
against a real Prometheus scraping a real exporter."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from exporter.model.catalogue import BY_NAME
from exporter.check.findings import round_up
from exporter.check.recommend import DEFAULT_HEADROOM, DEFAULT_WINDOW, memory_limit_needed
from exporter.model.state import HighWaterMark, StateStore
from tests.conftest import EVERY_FAMILY, REPO, Exporter, mounted_tmpfs, needs_root, value
from tests.live import Prometheus, fast_rules

RULES = os.path.join(REPO, "deploy", "prometheus", "shmwatch-recommend-rules.yml")
OPERATOR_RULE = os.path.join(REPO, "deploy", "kubernetes", "rules", "recommend-rules.yaml")
UNIT_TESTS = os.path.join(REPO, "tests", "rules", "recommend_test.yml")
RUNBOOK = os.path.join(REPO, "deploy", "prometheus", "runbook.md")
MiB, GiB = 1 << 20, 1 << 30


def promtool():
    return shutil.which("promtool") or pytest.fail("promtool not installed (Debian 'prometheus'; .ci/run installs it)")


def load_rules():
    with open(RULES) as f:
        return yaml.safe_load(f)


def squeeze(expr):
    return re.sub(r"\s+", "", expr)


# --- the high-water mark -------------------------------------------------------------------------
def test_state_store_keeps_the_high_water_mark_and_when_it_was_first_reached():
    now = [100.0]
    wall = [1_000.0]
    store = StateStore(peak_window=10, clock=lambda: now[0], wall_clock=lambda: wall[0])
    for used, t in ((5, 0), (40, 1), (40, 2), (3, 3)):
        now[0], wall[0] = 100.0 + t, 1_000.0 + t
        store.record_used("/dev/shm", used)
    now[0] += 60  # the peak window has moved on; the high-water mark has not
    snap = store.snapshot()
    assert snap.max_used["/dev/shm"] == HighWaterMark(used_bytes=40, at=1_001.0)
    assert snap.peaks["/dev/shm"] == 3
    store.forget_mounts_except([])
    assert store.snapshot().max_used == {}


@needs_root
def test_a_40mib_spike_freed_after_1_5s_leaves_the_high_water_mark():
    with mounted_tmpfs("64m") as shm, \
            Exporter(f"--shm.mount={shm}", "--no-collector.gpu", "--no-collector.segments",
                     "--poll-interval=1s", "--peak-window=2s", EVERY_FAMILY) as exporter:
        before = time.time()
        path = os.path.join(shm, "psm_spike")
        with open(path, "wb") as f:
            f.write(b"\1" * (40 * MiB))
        exporter.wait_for(lambda s: (value(s, "shmwatch_mount_peak_used_bytes", mount=shm) or 0) >= 40 * MiB)
        os.unlink(path)
        freed = time.time()
        # Once the peak window has passed, only the high-water mark remembers the spike.
        samples = exporter.wait_for(lambda s: (value(s, "shmwatch_mount_peak_used_bytes", mount=shm) or 1) < MiB,
                                    timeout=15)
    assert value(samples, "shmwatch_mount_used_bytes", mount=shm) < MiB
    assert value(samples, "shmwatch_mount_max_used_bytes", mount=shm) >= 40 * MiB
    reached = value(samples, "shmwatch_mount_max_used_timestamp_seconds", mount=shm)
    assert before <= reached <= freed, (before, reached, freed)  # reached during the spike, wall clock


@needs_root
def test_inotify_events_feed_the_high_water_mark_between_polls():
    """Polls a minute apart: the spike is seen only through inotify events (their own statvfs
    and the quick runs they wake), and it stays in the high-water mark after it is freed."""
    with mounted_tmpfs("64m") as shm, \
            Exporter(f"--shm.mount={shm}", "--no-collector.gpu", "--no-collector.segments",
                     "--poll-interval=60s", "--inventory-interval=60s", EVERY_FAMILY) as exporter:
        exporter.wait_for(lambda s: value(s, "shmwatch_inotify_active", mount=shm) == 1)
        path = os.path.join(shm, "psm_spike")
        with open(path, "wb") as f:
            f.write(b"\1" * (40 * MiB))
        # Polls are a minute apart: only the events can show the spike.
        exporter.wait_for(lambda s: (value(s, "shmwatch_mount_max_used_bytes", mount=shm) or 0) >= 40 * MiB)
        os.unlink(path)
        samples = exporter.wait_for(lambda s: value(s, "shmwatch_mount_used_bytes", mount=shm) < MiB, timeout=10)
    assert value(samples, "shmwatch_mount_max_used_bytes", mount=shm) >= 40 * MiB


# --- the recording rules ----------------------------------------------------------------------
def rule_exprs(window=DEFAULT_WINDOW, headroom=DEFAULT_HEADROOM):
    """record name -> PromQL: exporter/check/recommend.py's formula, as the rules carry it."""
    x = f"shmwatch:mount_observed_peak_bytes * {headroom:g}"
    return {
        "shmwatch:mount_observed_peak_bytes": f"max_over_time(shmwatch_mount_peak_used_bytes[{window}])",
        "shmwatch:mount_recommended_size_bytes": (
            f"clamp_min((ceil({x} / {GiB}) * {GiB} and {x} >= {GiB}) or ceil({x} / {MiB}) * {MiB}, {MiB})"),
        # The mount's pod (node mode) or the one workload (sidecar: no pod_uid on either side).
        "shmwatch:mount_recommended_memory_limit_bytes": (
            "ceil((shmwatch:mount_recommended_size_bytes + clamp_min(max by (instance, job, pod_uid) "
            "(shmwatch_cgroup_memory_working_set_bytes) - on (instance, job, pod_uid) group_right () "
            f"shmwatch_mount_used_bytes, 0)) / {MiB}) * {MiB}"),
    }


def test_rules_file_is_the_python_formula_and_is_valid():
    result = subprocess.run([promtool(), "check", "rules", RULES], capture_output=True, text=True)
    assert result.returncode == 0 and "WARNING" not in (result.stdout + result.stderr).upper(), result.stdout
    rules = [r for g in load_rules()["groups"] for r in g["rules"]]
    recorded = {r["record"]: r["expr"] for r in rules if "record" in r}
    assert {k: squeeze(v) for k, v in recorded.items()} == {k: squeeze(v) for k, v in rule_exprs().items()}, \
        "deploy/prometheus/shmwatch-recommend-rules.yml and rule_exprs() differ"
    from tests.system.test_rules import metric_names
    for rule in rules:
        unknown = {n for n in metric_names(rule["expr"]) - set(recorded) if n not in BY_NAME}
        assert not unknown, f"{rule.get('record') or rule.get('alert')}: not in the catalogue: {unknown}"
    with open(RUNBOOK) as f:
        headings = {line[3:].strip().lower() for line in f if line.startswith("## ")}
    for alert in (r for r in rules if "alert" in r):
        anchor = alert["annotations"]["runbook_url"].rsplit("#", 1)[1]
        assert anchor == alert["alert"].lower() and anchor in headings, f"{alert['alert']}: runbook section missing"
    with open(OPERATOR_RULE) as f:
        manifest = next(d for d in yaml.safe_load_all(f) if d)
    assert manifest["spec"] == load_rules(), "regenerate: python3 deploy/mixin/render.py"
    with open(os.path.join(REPO, "deploy", "prometheus", "prometheus.yml")) as f:
        assert "shmwatch-recommend-rules.yml" in yaml.safe_load(f)["rule_files"]


def test_promtool_unit_tests():
    """10 GiB a day ago and 2 GiB since; a peak a week ago inside and outside the window;
    the memory-limit alert firing (sidecar and node mode) and quiet."""
    result = subprocess.run([promtool(), "test", "rules", UNIT_TESTS], capture_output=True, text=True)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout[-6000:] + result.stderr[-2000:]


PEAKS = [0, 1, 4096, 40 * MiB, 40 * MiB + 1, 819 * MiB, 820 * MiB, 858993459, GiB - 1, GiB, 10 * GiB,
         int(12.3 * GiB), 100 * GiB + 12345, 1000 * GiB]


def test_rules_and_python_agree(tmp_path):
    """The same peaks through promtool and through exporter/check/recommend.py give the same bytes."""
    series, expected_size, expected_limit = [], [], []
    working_set, used = 3 * GiB + 7 * MiB, GiB
    for i, peak in enumerate(PEAKS):
        labels = f'instance="i{i}", job="shmwatch", mount="/dev/shm"'
        series += [{"series": f"shmwatch_mount_peak_used_bytes{{{labels}}}", "values": f"{peak}x5"},
                   {"series": f"shmwatch_mount_used_bytes{{{labels}}}", "values": f"{used}x5"},
                   {"series": f'shmwatch_cgroup_memory_working_set_bytes{{instance="i{i}", job="shmwatch", '
                              f'cgroup="/"}}', "values": f"{working_set}x5"}]
        size = round_up(peak * DEFAULT_HEADROOM)  # as check's recommend()
        expected_size.append({"labels": f"shmwatch:mount_recommended_size_bytes{{{labels}}}", "value": size})
        expected_limit.append({"labels": f"shmwatch:mount_recommended_memory_limit_bytes{{{labels}}}",
                               "value": memory_limit_needed(size, working_set, used)})
    tests = {"rule_files": [RULES], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [
            {"expr": "shmwatch:mount_recommended_size_bytes", "eval_time": "5m", "exp_samples": expected_size},
            {"expr": "shmwatch:mount_recommended_memory_limit_bytes", "eval_time": "5m",
             "exp_samples": expected_limit}]}]}
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool(), "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    # And the numbers are the documented ones.
    assert [round_up(p * DEFAULT_HEADROOM) for p in (0, 40 * MiB, 819 * MiB, 820 * MiB, 10 * GiB)] == \
        [MiB, 50 * MiB, 1024 * MiB, 2 * GiB, 13 * GiB]


# --- shmwatch check --recommend, live ---------------------------------------------------------
def check(*args):
    result = subprocess.run([sys.executable, "-m", "exporter", "check", "--no-collector.gpu", "--recommend",
                             "--output", "json", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return json.loads(result.stdout)


def project_rules(path):
    """Both shipped rule files (tests/live.py's fast_rules loads the recommendation's too),
    with short group intervals and `for:` so the test does not wait."""
    fast_rules(path)


@needs_root
def test_check_recommend_from_a_real_prometheus_and_its_fallbacks(tmp_path):
    rules = str(tmp_path / "rules.yml")
    project_rules(rules)
    with mounted_tmpfs("256m") as shm, \
            Exporter(f"--shm.mount={shm}", "--no-collector.gpu", "--poll-interval=1s", "--peak-window=5s") as exporter, \
            Prometheus(str(tmp_path), [f"127.0.0.1:{exporter.port}"], rules=rules) as prom:
        assert prom.wait_query('up{job="shmwatch"} == 1'), "Prometheus does not scrape shmwatch"
        path = os.path.join(shm, "psm_spike")
        with open(path, "wb") as f:
            f.write(b"\1" * (40 * MiB))
        exporter.wait_for(lambda s: (value(s, "shmwatch_mount_peak_used_bytes", mount=shm) or 0) >= 40 * MiB)
        os.unlink(path)
        recorded = prom.wait_query(f"shmwatch:mount_recommended_size_bytes >= {40 * MiB}", timeout=30)
        assert recorded, "the recording rule never saw the spike"
        assert float(recorded[0]["value"][1]) == round_up(40 * MiB * DEFAULT_HEADROOM) == 50 * MiB

        doc = check(f"--shm.mount={shm}", f"--prometheus.url={prom.url}", '--prometheus.selector=job="shmwatch"')
        rec = doc["recommendations"][0]
        assert rec["source"] == "prometheus" and rec["window"] == "7d", rec
        assert rec["observed_peak_bytes"] >= 40 * MiB and rec["recommended_size_bytes"] >= 40 * MiB
        assert rec["recommended_size_bytes"] == float(recorded[0]["value"][1])  # check and the rule agree
        assert rec["settings"]["docker_run"] == "docker run --shm-size=50m"
        assert rec["settings"]["compose"] == "shm_size: 50m" and "sizeLimit: 50Mi" in rec["settings"]["kubernetes_volume"]

        text = subprocess.run([sys.executable, "-m", "exporter", "check", "--no-collector.gpu", "--recommend",
                               f"--shm.mount={shm}", f"--prometheus.url={prom.url}"], cwd=REPO,
                              capture_output=True, text=True, timeout=60).stdout
        assert "(Prometheus, max over 7d) -> recommended 50.0 MiB" in text and "--shm-size=50m" in text, text

        # Without Prometheus: a running exporter's high-water mark, then this run's own reading.
        dead = prom.url  # stopped below
        from_exporter = check(f"--shm.mount={shm}", f"--exporter.url={exporter.url}")
        rec = from_exporter["recommendations"][0]
        assert rec["source"] == "exporter" and rec["observed_peak_bytes"] >= 40 * MiB and rec["window"] is None
    # Prometheus and the exporter are gone now: the fallback is named, and so is why.
    with mounted_tmpfs("256m") as shm:
        alone = check(f"--shm.mount={shm}", f"--prometheus.url={dead}", f"--exporter.url={exporter.url}")
    rec = alone["recommendations"][0]
    assert rec["source"] == "current" and rec["recommended_size_bytes"] == MiB
    assert any("Prometheus not used" in n for n in alone["recommendation_notes"])
    assert any("exporter not used" in n for n in alone["recommendation_notes"])
    assert any("current use only" in n for n in rec["notes"])
