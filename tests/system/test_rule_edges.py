"""Every alert at its edges, with promtool: just at (or under) the threshold stays quiet,
over it for less than `for:` stays quiet, over it for `for:` fires.

The thresholds and `for:` durations below are the reviewed contract, written here on
purpose rather than read back from the rules: a test that derived them from the rule
file would follow a changed threshold and pass. What is read from the rules is only
which alerts exist (every alert in deploy/prometheus/*.yml must have edges here), so the
cases survive the rules being generated from a jsonnet mixin, as long as the rendered
YAML lands in deploy/prometheus/ with the same alert names.
"""
import glob
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import pytest
import yaml

from tests.conftest import REPO

RULE_FILES = sorted(glob.glob(os.path.join(REPO, "deploy", "prometheus", "*.yml")))

L = 'instance="a", job="shmwatch"'
M = L + ', mount="/dev/shm"'
CG = L + ', cgroup="/kubepods/pod1"'
GPU = L + ', gpu="0", uuid="GPU-1"'
LI = {"instance": "a", "job": "shmwatch"}
LM = {**LI, "mount": "/dev/shm"}
LCG = {**LI, "cgroup": "/kubepods/pod1"}
MiB = 1 << 20

Series = Dict[str, str]


def const(value, n=60) -> str:
    return f"{value}x{n}"


@dataclass
class Edge:
    """One alert's contract: `series(level)` holds a level from t=0 (true from `start`
    minutes on, where a rate or a history needs samples first); `quiet` is the last level
    that must not fire (the threshold itself for a strict comparison), `fire` the first
    that must; `for_m` the alert's `for:` in minutes."""
    for_m: int
    series: Callable[[object], Series]
    quiet: object
    fire: object
    labels: Dict[str, str]
    start: int = 0
    # Further inputs that must stay quiet for a long time (a wrong class, a flat rate…).
    also_quiet: List[Series] = field(default_factory=list)
    # Further inputs that must fire: (series, eval minutes).
    also_fire: List[Tuple[Series, int]] = field(default_factory=list)


def ratio(num_series, den_series, den=1000):
    return lambda level: {num_series: const(level * den if isinstance(level, float) else level),
                          den_series: const(den)}


EDGES: Dict[str, Edge] = {
    "ShmUsageHigh": Edge(5, ratio(f"shmwatch_mount_used_bytes{{{M}}}", f"shmwatch_mount_size_bytes{{{M}}}"),
                         0.8, 0.81, LM),
    "ShmUsageCritical": Edge(1, ratio(f"shmwatch_mount_used_bytes{{{M}}}", f"shmwatch_mount_size_bytes{{{M}}}"),
                             0.95, 0.96, LM),
    # A 2000 MiB mount filling 40 MiB a minute from v MiB used: predicted full within the
    # hour from the second sample on; half full is the edge. From 360 MiB it reaches exactly
    # half at the last minute evaluated (16); from 961 MiB it is just over half from minute 1.
    "ShmFillingUp": Edge(10, lambda v: {f"shmwatch_mount_used_bytes{{{M}}}": f"{v * MiB}+{40 * MiB}x40",
                                        f"shmwatch_mount_size_bytes{{{M}}}": const(2000 * MiB)}, 360, 961, LM,
                         start=1,
                         # Filling, but slowly enough to last the hour: quiet however full.
                         also_quiet=[{f"shmwatch_mount_used_bytes{{{M}}}": f"{18000 * MiB}+{20 * MiB}x40",
                                      f"shmwatch_mount_size_bytes{{{M}}}": const(20000 * MiB)}]),
    "ShmPeakNearFull": Edge(0, lambda v: {f"shmwatch_mount_peak_used_bytes{{{M}}}": const(v),
                                          f"shmwatch_mount_size_bytes{{{M}}}": const(100),
                                          f"shmwatch_mount_used_bytes{{{M}}}": const(50)}, 95, 96, LM,
                            # Usage itself at 0.95 still counts as "lower now"; above, ShmUsageCritical's turf.
                            also_fire=[({f"shmwatch_mount_peak_used_bytes{{{M}}}": const(97),
                                         f"shmwatch_mount_size_bytes{{{M}}}": const(100),
                                         f"shmwatch_mount_used_bytes{{{M}}}": const(95)}, 0)],
                            also_quiet=[{f"shmwatch_mount_peak_used_bytes{{{M}}}": const(970),
                                         f"shmwatch_mount_size_bytes{{{M}}}": const(1000),
                                         f"shmwatch_mount_used_bytes{{{M}}}": const(951)}]),
    # Fires at <= 64 MiB: "quiet" is one byte more.
    "ShmDockerDefaultSize": Edge(5, lambda v: {f"shmwatch_mount_size_bytes{{{M}}}": const(v),
                                               f'shmwatch_segments{{{M}, class="nccl", state="linked"}}': const(1)},
                                 64 * MiB + 1, 64 * MiB, LM,
                                 also_quiet=[{f"shmwatch_mount_size_bytes{{{M}}}": const(64 * MiB),
                                              f'shmwatch_segments{{{M}, class="vllm_offload", state="linked"}}':
                                                  const(3)},
                                             {f"shmwatch_mount_size_bytes{{{M}}}": const(64 * MiB),
                                              f'shmwatch_segments{{{M}, class="nccl", state="linked"}}': const(0)}]),
    "ShmLeakedSegments": Edge(15, ratio(f'shmwatch_segment_bytes{{{M}, class="python_shm", state="orphan"}}',
                                        f"shmwatch_mount_size_bytes{{{M}}}"), 100, 101, LM,
                              also_quiet=[{f'shmwatch_segment_bytes{{{M}, class="semaphore", state="orphan"}}':
                                           const(900), f"shmwatch_mount_size_bytes{{{M}}}": const(1000)},
                                          {f'shmwatch_segment_bytes{{{M}, class="other", state="orphan"}}':
                                           const(900), f"shmwatch_mount_size_bytes{{{M}}}": const(1000)},
                                          {f'shmwatch_segment_bytes{{{M}, class="python_shm", state="unverified"}}':
                                           const(900), f"shmwatch_mount_size_bytes{{{M}}}": const(1000)},
                                          {f'shmwatch_segment_bytes{{{M}, class="nccl", state="linked"}}':
                                           const(900), f"shmwatch_mount_size_bytes{{{M}}}": const(1000)}]),
    "ShmLeakedSegmentsOld": Edge(15, lambda v: {f"shmwatch_orphan_oldest_age_seconds{{{M}}}": const(v)},
                                 6 * 3600, 6 * 3600 + 1, LM),
    "ShmHiddenSegmentsLarge": Edge(30, ratio(f'shmwatch_segment_bytes{{{M}, class="nccl", state="hidden"}}',
                                             f"shmwatch_mount_size_bytes{{{M}}}"), 500, 501, LM),
    "ShmMountMissing": Edge(5, lambda v: {f"shmwatch_mount_error{{{M}}}": const(v)}, 0, 1, LM),
    "ShmInventoryDegraded": Edge(15, lambda v: {f"shmwatch_inventory_degraded{{{M}}}": const(v)}, 0, 1, LM),
    "PodOomRiskHigh": Edge(5, ratio(f"shmwatch_cgroup_memory_working_set_bytes{{{CG}}}",
                                     f'shmwatch_cgroup_memory_limit_bytes{{{CG}, limit_from="pod"}}'), 0.9, 0.91, LCG),
    "ShmSizeExceedsMemoryLimit": Edge(15, lambda v: {f'shmwatch_shm_oom_projection_ratio{{{CG}, mount="/dev/shm"}}':
                                                     const(v)}, 1, 1.01, {**LCG, "mount": "/dev/shm"}),
    # A kill at minute 3 fires at once; a counter that never moved does not, and ten
    # minutes after the kill it is quiet again.
    "PodOomKilled": Edge(0, lambda v: {f"shmwatch_cgroup_oom_kills_total{{{CG}}}": f"2 2 2 {2 + v}x40"}, 0, 1, LCG,
                         start=3, also_quiet=[{f"shmwatch_cgroup_oom_kills_total{{{CG}}}": "2 2 2 3x40"}]),
    # Over memory.high all along: shm at half of it stays quiet, a byte more fires; shm at
    # 90 % of it with memory.events' high flat (not throttled) stays quiet.
    "PodThrottledAtMemoryHigh": Edge(
        5, lambda v: {f"shmwatch_cgroup_memory_shmem_bytes{{{CG}}}": const(v),
                      f"shmwatch_cgroup_memory_high_bytes{{{CG}}}": const(1000),
                      f'shmwatch_cgroup_memory_events_total{{{CG}, event="high"}}': "0+3x60"}, 500, 501, LCG,
        start=1,
        also_quiet=[{f"shmwatch_cgroup_memory_shmem_bytes{{{CG}}}": const(900),
                     f"shmwatch_cgroup_memory_high_bytes{{{CG}}}": const(1000),
                     f'shmwatch_cgroup_memory_events_total{{{CG}, event="high"}}': const(7)}]),
    # A peak of 8 GiB asks for 10 GiB of shm; the rest of the pod uses 3 - 1 = 2 GiB: the
    # limit that holds both is 12 GiB. At 12 GiB it is quiet, a byte under it fires.
    "ShmRecommendationExceedsMemoryLimit": Edge(
        30, lambda v: {f"shmwatch_mount_peak_used_bytes{{{M}}}": const(8 << 30),
                       f"shmwatch_mount_used_bytes{{{M}}}": const(1 << 30),
                       f"shmwatch_cgroup_memory_working_set_bytes{{{CG}}}": const(3 << 30),
                       f"shmwatch_cgroup_memory_limit_bytes{{{CG}}}": const(v)},
        12 << 30, (12 << 30) - 1, LM),
    "HostMemoryLow": Edge(5, lambda v: {f"shmwatch_host_memory_available_bytes{{{L}}}": const(v),
                                        f"shmwatch_host_memory_total_bytes{{{L}}}": const(1000)}, 100, 99, LI),
    "SysvSegmentsNearLimit": Edge(5, ratio(f"shmwatch_sysv_segments{{{L}}}", f"shmwatch_sysv_limit_shmmni{{{L}}}"),
                                  900, 901, LI),
    "SysvBytesNearLimit": Edge(5, ratio(f"shmwatch_sysv_bytes{{{L}}}", f"shmwatch_sysv_limit_shmall_bytes{{{L}}}"),
                               900, 901, LI),
    "GpuMemoryNearlyFull": Edge(10, ratio(f"shmwatch_gpu_memory_used_bytes{{{GPU}}}",
                                          f"shmwatch_gpu_memory_total_bytes{{{GPU}}}"), 980, 981,
                                {**LI, "gpu": "0", "uuid": "GPU-1"}),
    "ShmwatchDown": Edge(5, lambda v: {f"up{{{L}}}": const(v)}, 1, 0, LI,
                         also_quiet=[{'up{instance="a", job="node"}': const(0)}]),
    "ShmwatchCollectorFailing": Edge(10, lambda v: {f'shmwatch_collector_success{{{L}, collector="segments"}}':
                                                    const(v)}, 1, 0, {**LI, "collector": "segments"},
                                     also_quiet=[{f'shmwatch_collector_success{{{L}, collector="gpu"}}': const(0)}]),
    # GPUs seen for 10 minutes, then NVML fails from minute 10 on.
    "ShmwatchGpuCollectorFailing": Edge(
        5, lambda v: {f'shmwatch_collector_success{{{L}, collector="gpu"}}': f"1x9 {v}x60",
                      f'shmwatch_gpu_info{{{GPU}, name="H100", driver_version="550"}}': "1x9 _x60"},
        1, 0, {**LI, "collector": "gpu"}, start=10,
        # A CPU-only node never had a GPU: quiet. GPUs last seen over an hour ago still page
        # (issue 20: however long a seen GPU stays gone).
        also_quiet=[{f'shmwatch_collector_success{{{L}, collector="gpu"}}': const(0, 100)}],
        also_fire=[({f'shmwatch_collector_success{{{L}, collector="gpu"}}': "1x5 0x100",
                     f'shmwatch_gpu_info{{{GPU}, name="H100", driver_version="550"}}': "1x5 _x100"}, 100)]),
}


def shipped_alerts() -> Dict[str, dict]:
    found = {}
    for path in RULE_FILES:
        with open(path) as f:
            doc = yaml.safe_load(f)
        for group in (doc or {}).get("groups", []) if isinstance(doc, dict) else []:
            for rule in group["rules"]:
                if "alert" in rule:
                    assert rule["alert"] not in found, f"{rule['alert']} defined twice"
                    found[rule["alert"]] = rule
    return found


def promtool() -> str:
    return shutil.which("promtool") or pytest.fail("promtool not installed (Debian 'prometheus'; .ci/run installs it)")


def case(alert: str, series: Series, at_m: int, fires: bool, labels: Dict[str, str], severity: str) -> dict:
    expected = [{"exp_labels": {**labels, "severity": severity}}] if fires else []
    return {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": [{"eval_time": f"{at_m}m", "alertname": alert, "exp_alerts": expected}]}


def edge_cases(alert: str, edge: Edge, severity: str) -> List[Tuple[str, dict]]:
    fire_at = edge.start + edge.for_m
    long_after = fire_at + 5
    out = [
        (f"{alert}: {edge.quiet} stays quiet after {long_after}m",
         case(alert, edge.series(edge.quiet), long_after, False, edge.labels, severity)),
        (f"{alert}: {edge.fire} fires after {edge.for_m}m",
         case(alert, edge.series(edge.fire), fire_at, True, edge.labels, severity)),
    ]
    if edge.for_m:
        out.append((f"{alert}: {edge.fire} for {edge.for_m - 1}m stays quiet (for: {edge.for_m}m)",
                    case(alert, edge.series(edge.fire), fire_at - 1, False, edge.labels, severity)))
    for i, series in enumerate(edge.also_quiet):
        out.append((f"{alert}: extra quiet case {i}", case(alert, series, long_after + 60, False, edge.labels,
                                                           severity)))
    for i, (series, at) in enumerate(edge.also_fire):
        out.append((f"{alert}: extra firing case {i}", case(alert, series, at, True, edge.labels, severity)))
    return out


def test_every_shipped_alert_has_edges():
    assert RULE_FILES, "no rule files in deploy/prometheus"
    assert sorted(shipped_alerts()) == sorted(EDGES), "every alert needs its edges in EDGES"


def stripped_rules(tmp_path) -> str:
    """The shipped rules, alerts without annotations (promtool would compare them; the live
    test checks them rendered), in one file: recording rules too, since some alerts read
    them (shmwatch:gpus_seen, the shm size recommendation), each group at its own interval."""
    groups = []
    for path in RULE_FILES:
        with open(path) as f:
            doc = yaml.safe_load(f)
        for group in doc.get("groups", []):
            rules = [{k: v for k, v in r.items() if k != "annotations"} for r in group["rules"]]
            groups.append({**group, "rules": rules})
    path = tmp_path / "alerts.yml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return str(path)


def test_alert_edges_with_promtool(tmp_path):
    alerts = shipped_alerts()
    named = []
    for alert, edge in EDGES.items():
        named += edge_cases(alert, edge, alerts[alert]["labels"]["severity"])
    rules = stripped_rules(tmp_path)
    # One promtool run for all cases (one process start instead of ~80); on failure, run
    # them one by one to say which edge broke.
    doc = {"rule_files": [rules], "evaluation_interval": "1m", "tests": [c for _, c in named]}
    (tmp_path / "edges.yml").write_text(yaml.safe_dump(doc))
    result = subprocess.run([promtool(), "test", "rules", str(tmp_path / "edges.yml")], capture_output=True,
                            text=True, timeout=120)
    if result.returncode == 0:
        assert "SUCCESS" in result.stdout
        return
    broken = []
    for i, (name, c) in enumerate(named):
        one = tmp_path / f"edge{i}.yml"
        one.write_text(yaml.safe_dump({**doc, "tests": [c]}))
        if subprocess.run([promtool(), "test", "rules", str(one)], capture_output=True, timeout=60).returncode:
            broken.append(name)
    pytest.fail("edges broken:\n  " + "\n  ".join(broken or ["(none alone)"]) + "\n" + result.stdout[-3000:]
                + result.stderr[-3000:])
