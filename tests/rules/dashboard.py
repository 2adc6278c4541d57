"""The dashboard's queries on a synthetic world of exporters, with Grafana's variables set.

The world: sidecars (a PodMonitor's target labels: the workload's namespace and pod) and
node-mode exporters (the DaemonSet's target labels; a pod's series by pod_uid, its mounts by
their volume and its cgroup by the pod_uid alone, named by shmwatch:pod_info, given here as a
series; the host's with no pod_uid; node series such as host memory and GPUs), each
exporting every metric of exporter/model/catalogue.py (the opt-in ones too) with the labels
node_labels gives it, every series a different value. Beside the pods a selection
shows stand the ones it must not: another job, another instance, the same pod name in
another namespace, another pod, another mount, the DaemonSet's own labels.

A Selection is what a user picks in the variables, and by hand which exporters' series the
dashboard must then show (the spec); tests/rules/dashboard_expect.py says what each query
makes of them, and test_dashboard_values.py runs every query for every selection.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Tuple

from exporter.model.catalogue import CATALOGUE, Metric, node_labels
from tests.rules.promql import metric_names, parse
from tests.rules.scenario import SAMPLES, Equals, Sample, Scenario, Series, selector

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(REPO, "grafana", "shmwatch.json")
AT = "65m"  # an hour of history for increase(...[1h])
AT_MINUTES = 65
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval), with
# the data source's scrape interval set to the synthetic series' 1m.
RATE_INTERVAL = "4m"
RECORDED_MOUNT_SERIES = (
    "shmwatch:mount_usage_ratio",
    "shmwatch:mount_recommended_size_bytes",
    "shmwatch:mount_observed_peak_bytes",
    "shmwatch:mount_recommended_memory_limit_bytes",
)
RECORDED_CGROUP_SERIES = ("shmwatch:oom_risk_ratio",)


@dataclass(frozen=True)
class Source:
    """Series of one shape from one exporter: a sidecar's, node mode's series of one pod,
    of the host (no pod_uid), or of the node itself (metrics node_labels gives no pod_uid)."""

    key: str
    target: Dict[str, str]  # job, instance, namespace, pod as scraped
    kind: str  # sidecar, pod, host, node
    uid: str = ""
    mounts: Tuple[str, ...] = ()  # paths; a pod's: its volumes
    only: Optional[FrozenSet[str]] = None  # a probe that exports just these metrics


def sidecar(key: str, job: str, instance: str, namespace: str, pod: str, *mounts: str) -> Source:
    target = {"job": job, "instance": instance, "namespace": namespace, "pod": pod}
    return Source(key=key, target=target, kind="sidecar", mounts=mounts or ("/dev/shm",))


def daemonset(job: str, instance: str, pod: str) -> Dict[str, str]:
    return {"job": job, "instance": instance, "namespace": "shmwatch", "pod": pod}


NODE_A = daemonset("shmwatch-node", "10.0.1.9:9841", "shmwatch-node-a")
NODE_B = daemonset("shmwatch-node", "10.0.2.9:9841", "shmwatch-node-b")
CANARY = daemonset("shmwatch-node-canary", "10.0.1.9:9842", "shmwatch-canary-a")
# Nodes each with one pod that shmwatch sees one way only: its emptyDir, its memory cgroup,
# its IPC namespace (which tell the dashboard which node's series a pod's panels show).
PROBES = {
    "C": (daemonset("shmwatch-node", "10.0.3.9:9841", "shmwatch-node-c"), "u5", "shmwatch_mount_size_bytes"),
    "D": (
        daemonset("shmwatch-node", "10.0.4.9:9841", "shmwatch-node-d"),
        "u6",
        "shmwatch_cgroup_memory_working_set_bytes",
    ),
    "E": (daemonset("shmwatch-node", "10.0.5.9:9841", "shmwatch-node-e"), "u7", "shmwatch_sysv_segments"),
}
# kube-state-metrics' names of the pods, as shmwatch:pod_info records them.
PODS = {
    "u1": ("llm", "sglang-1"),
    "u2": ("batch", "trainer-0"),
    "u3": ("llm", "sglang-2"),
    "u4": ("batch", "sglang-1"),
    "u5": ("llm", "sglang-5"),
    "u6": ("llm", "sglang-6"),
    "u7": ("llm", "sglang-7"),
    "ds-a": ("shmwatch", "shmwatch-node-a"),
}


def node_sources(name: str, target: Dict[str, str], pods: Dict[str, Tuple[str, ...]]) -> List[Source]:
    out = [
        Source(key=f"{name} node", target=target, kind="node"),
        Source(key=f"{name} host", target=target, kind="host", mounts=("/dev/shm",)),
    ]
    out += [
        Source(key=f"{name} {uid}", target=target, kind="pod", uid=uid, mounts=vols)
        for uid, vols in pods.items()
    ]
    return out


def probe_sources() -> List[Source]:
    out = []
    for name, (target, uid, metric) in PROBES.items():
        out.append(Source(key=f"{name} node", target=target, kind="node"))
        out.append(
            Source(
                key=f"{name} {uid}",
                target=target,
                kind="pod",
                uid=uid,
                mounts=("dshm",),
                only=frozenset({metric}),
            )
        )
    return out


SOURCES: Tuple[Source, ...] = tuple(
    [
        sidecar("vllm-0", "shmwatch", "10.0.0.5:9841", "llm", "vllm-0", "/dev/shm", "/mnt/cache"),
        sidecar("vllm-1", "shmwatch", "10.0.0.6:9841", "llm", "vllm-1"),
        sidecar("batch vllm-0", "shmwatch", "10.0.0.7:9841", "batch", "vllm-0"),
        sidecar("canary vllm-0", "shmwatch-canary", "10.0.0.5:9841", "llm", "vllm-0"),
    ]
    + node_sources("A", NODE_A, {"u1": ("dshm", "cache"), "u3": ("dshm",)})
    + node_sources("B", NODE_B, {"u2": ("dshm",), "u4": ("dshm",)})
    + node_sources("canary", CANARY, {"u1": ("dshm",)})
    + probe_sources()
    # A pod kube-state-metrics does not name (yet): shown nowhere.
    + [Source(key="A u9", target=NODE_A, kind="pod", uid="u9", mounts=("dshm",))]
)
BY_KEY = {s.key: s for s in SOURCES}
INDEX = {s.key: i for i, s in enumerate(SOURCES)}

# Values that mean something to a panel, by (metric, source key): SysV namespaces shmwatch
# could not read (0); kernel.shmall at its default (huge: the panel clamps it).
UNREADABLE = ("vllm-0", "vllm-1", "batch vllm-0", "canary vllm-0", "A u3", "A u9", "B u2", "B u4", "canary u1")
SPECIAL: Dict[Tuple[str, str], float] = {
    **{("shmwatch_sysv_namespace_readable", k): 0 for k in UNREADABLE},
    ("shmwatch_sysv_limit_shmall_bytes", "vllm-0"): 18446744073692774400,
}
# memory.events' high counter where it stays put: never throttled (0), or once long ago (1).
THROTTLED_ONCE = {"vllm-0": 1, "vllm-1": 0, "A u1": 0, "A host": 0}
# Series a source does not have, by metric name prefix: the canary's node has no GPU, its
# host_memory collector fails, and it could not count hidden processes (no
# shmwatch_proc_unreadable); its pod has no memory limit.
ABSENT: Dict[str, Tuple[str, ...]] = {
    "canary node": ("shmwatch_gpu_", "shmwatch_host_memory_", "shmwatch_proc_unreadable"),
    "canary u1": ("shmwatch_cgroup_memory_limit_bytes",),
}
# OOM kills (the minutes each happened): one in the last hour is drawn as 1.
KILLS: Dict[str, Tuple[int, ...]] = {
    "vllm-0": (3, 30),
    "vllm-1": (2,),
    "canary vllm-0": (30, 40),
    "A u1": (2, 50),
    "A u3": (20, 30, 64),
    "B u2": (5, 6),
    "canary u1": (61,),
}
# Panels that show the least of several series (1 is good): there a series that should not
# be shown has a lower value than those that should, elsewhere a higher one.
LOW_IS_WORSE = ("shmwatch_collector_success", "shmwatch_inotify_active", "shmwatch_mount_owners_verified")
# Label values for the labels a metric has besides the mount, cgroup and node labels: one
# series for each value, and for each combination of several labels' values.
VARIANTS: Dict[str, Tuple[str, ...]] = {
    "class": ("nccl", "torch"),
    "state": ("orphan", "hidden", "linked"),
    "collector": ("segments", "gpu"),
    "gpu": ("0", "1"),
    "fstype": ("tmpfs",),
    "source": ("tmpfs",),
    "noswap": ("true",),
    "name": ("nccl-1",),
    "owner": ("python3",),
    "comm": ("python3",),
    "type": ("dir",),
    "version": ("0.1.0",),
    "driver_version": ("550",),
    "limit_from": ("self",),
}
EVENTS = {"shmwatch_segment_events_total": ("create", "delete"), "shmwatch_cgroup_memory_events_total": ("high", "max")}


def _metrics() -> Tuple[Metric, ...]:
    recorded = tuple(
        Metric(name=n, type="gauge", unit="", labels=("mount",), help="", default=True) for n in RECORDED_MOUNT_SERIES
    ) + tuple(
        Metric(name=n, type="gauge", unit="", labels=("cgroup",), help="", default=True) for n in RECORDED_CGROUP_SERIES
    )
    return tuple(m for m in CATALOGUE if m.name.startswith("shmwatch_")) + recorded


METRICS = _metrics()
METRIC_INDEX = {m.name: i for i, m in enumerate(METRICS)}


def per_pod(metric: Metric) -> bool:
    return metric.name in RECORDED_MOUNT_SERIES + RECORDED_CGROUP_SERIES or "pod_uid" in node_labels(metric)


def exports(source: Source, metric: Metric) -> bool:
    if source.only is not None:
        return metric.name in source.only
    if any(metric.name.startswith(prefix) for prefix in ABSENT.get(source.key, ())):
        return False
    if source.kind == "sidecar":
        return True
    return per_pod(metric) == (source.kind in ("pod", "host"))


def variants(metric: Metric) -> List[Dict[str, str]]:
    combos: List[Dict[str, str]] = [{}]
    for label in metric.labels:
        values = EVENTS[metric.name] if label == "event" else VARIANTS.get(label)
        if values is None:
            continue
        if label == "uuid":
            continue
        combos = [
            dict(c, **{label: v}, **({"uuid": f"GPU-{v}"} if label == "gpu" else {})) for c in combos for v in values
        ]
    return combos


def placed(source: Source, metric: Metric) -> List[Dict[str, str]]:
    """The source's label sets for the metric: its target labels, its mounts or its cgroup,
    node mode's labels; no empty label. A pod's mount is its volume, its cgroup its pod_uid."""
    base = dict(source.target)
    if source.kind in ("pod", "host") and source.uid:
        base["pod_uid"] = source.uid
    if "cgroup" in metric.labels and source.kind != "pod":
        base["cgroup"] = {"sidecar": "/", "host": "/system.slice"}[source.kind]
    if source.kind in ("pod", "host") and metric.name.startswith("shmwatch_sysv_"):
        base["ipc_namespace"] = f"ipc-{source.uid or 'host'}"
    if metric.name == "shmwatch_process_shm_bytes" and source.uid:
        base["process_pod_uid"] = source.uid
    if "mount" not in metric.labels:
        return [base]
    label = "volume" if source.kind == "pod" else "mount"
    return [dict(base, **{label: mount}) for mount in source.mounts]


def offset_of(source: Source, mount: int, variant: int) -> int:
    """Later sources, and a source's second mount, get higher offsets (the selections show
    earlier ones and leave later ones out); every series of a metric a different one."""
    return 100 * INDEX[source.key] + 50 * mount + variant + 1


def counter(start: float, rate: float) -> Tuple[float, ...]:
    """A counter rising 60 x rate in odd minutes and 180 x rate in even ones: over four
    minutes 480 x rate (a rate of 2 x rate a second), in the last one 60 or 180 x rate."""
    values, value = [], start
    for minute in range(SAMPLES + 1):
        if minute:
            value += rate * (60 if minute % 2 else 180)
        values.append(value)
    return tuple(values)


def steps(kills: Tuple[int, ...]) -> Tuple[float, ...]:
    return tuple(float(sum(1 for k in kills if k <= minute)) for minute in range(SAMPLES + 1))


def series_values(metric: Metric, source: Source, mount: int, variant: Dict[str, str], index: int) -> Tuple[float, ...]:
    if (metric.name, source.key) in SPECIAL:
        return (SPECIAL[(metric.name, source.key)],) * (SAMPLES + 1)
    if metric.name == "shmwatch_cgroup_oom_kills_total":
        return steps(KILLS.get(source.key, ()))
    if metric.name == "shmwatch_cgroup_memory_events_total" and variant.get("event") == "high":
        if source.key in THROTTLED_ONCE:
            return (float(THROTTLED_ONCE[source.key]),) * (SAMPLES + 1)
    offset = offset_of(source, mount, index)
    base = 100000 * (METRIC_INDEX[metric.name] + 1)
    if metric.type == "counter":
        return counter(base + offset, offset)
    value = base + 99999 - offset if metric.name in LOW_IS_WORSE else base + offset
    return (float(value),) * (SAMPLES + 1)


@dataclass(frozen=True)
class Point:
    """One synthetic series: its metric, source, labels and a value a minute."""

    metric: str
    source: str
    labels: Dict[str, str]
    series: Tuple[float, ...]

    def at(self, minute: int) -> float:
        return self.series[minute]

    def values(self) -> str:
        """promtool's notation, a run of equal values as `vxN`."""
        runs: List[str] = []
        i = 0
        while i < len(self.series):
            j = i
            while j + 1 < len(self.series) and self.series[j + 1] == self.series[i]:
                j += 1
            runs.append(f"{self.series[i]!r}x{j - i}" if j > i else repr(self.series[i]))
            i = j + 1
        return " ".join(runs)


def points_of(metric: Metric, source: Source) -> List[Point]:
    out = []
    for labels in placed(source, metric):
        where = labels.get("mount", labels.get("volume"))
        mount = source.mounts.index(where) if where in source.mounts else 0
        for i, variant in enumerate(variants(metric)):
            values = series_values(metric, source, mount, variant, i)
            out.append(Point(metric=metric.name, source=source.key, labels={**labels, **variant}, series=values))
    return out


def points() -> List[Point]:
    out = [p for metric in METRICS for source in SOURCES if exports(source, metric) for p in points_of(metric, source)]
    return out + alerts() + pod_info()


def alert(source: str, name: str, severity: str, state: str = "firing", **labels: str) -> Point:
    s = BY_KEY[source]
    base = dict(s.target, **({"pod_uid": s.uid} if s.uid else {}))
    full = {**base, "alertname": name, "alertstate": state, "severity": severity, **labels}
    return Point(metric="ALERTS", source=source, labels=full, series=(1.0,) * (SAMPLES + 1))


def alerts() -> List[Point]:
    """ALERTS as Prometheus writes them for the alerts firing (and one pending) in the world."""
    return [
        alert("vllm-0", "ShmUsageHigh", "warning", mount="/dev/shm"),
        alert("vllm-0", "PodOomRiskHigh", "warning", "pending", cgroup="/"),
        alert("vllm-0", "KubePodCrashLooping", "warning"),
        alert("vllm-1", "ShmUsageCritical", "critical", mount="/dev/shm"),
        alert("vllm-1", "HostMemoryLow", "warning"),
        alert("batch vllm-0", "ShmLeakedSegments", "warning", mount="/dev/shm"),
        alert("A u1", "ShmLeakedSegments", "warning", volume="dshm"),
        alert("A u3", "ShmUsageHigh", "warning", volume="dshm"),
        alert("A host", "ShmUsageHigh", "warning", mount="/dev/shm"),
        alert("A node", "HostMemoryLow", "warning"),
        alert("A node", "GpuMemoryNearlyFull", "warning", "pending", gpu="0", uuid="GPU-0"),
        alert("B node", "ShmwatchCollectorFailing", "warning", collector="segments"),
        alert("B u2", "PodOomRiskHigh", "warning"),
        alert("B u4", "ShmUsageCritical", "critical", volume="dshm"),
        alert("canary vllm-0", "ShmUsageHigh", "warning", mount="/dev/shm"),
        alert("canary u1", "ShmUsageHigh", "warning", volume="dshm"),
        alert("A u1", "PodThrottledAtMemoryHigh", "warning", "pending"),
        alert("A u1", "TeamShmBudget", "warning", volume="dshm"),
        alert("C node", "HostMemoryLow", "warning"),
        alert("D node", "GpuMemoryNearlyFull", "warning", gpu="1", uuid="GPU-1"),
        alert("E node", "ShmwatchCollectorFailing", "warning", collector="sysv"),
    ]


def pod_info() -> List[Point]:
    return [
        Point(
            metric="shmwatch:pod_info",
            source="kube-state-metrics",
            labels={"pod_uid": uid, "namespace": ns, "pod": pod},
            series=(1.0,) * (SAMPLES + 1),
        )
        for uid, (ns, pod) in PODS.items()
    ]


WORLD = points()


def series_for(names: FrozenSet[str]) -> Series:
    """The world's series of the named metrics (a query's inputs)."""
    return {selector(p.metric, p.labels): p.values() for p in WORLD if p.metric in names}


# ---- selections ----------------------------------------------------------------------

ALL: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Selection:
    """The values picked in the dashboard's variables (ALL: "All"), and by hand the sources
    whose series the dashboard must show: by their own labels (a sidecar's, the host's and
    the node's series, pod_uid empty), as a named pod (node mode), and the node series of
    the exporters that watch a selected pod."""

    name: str
    job: Tuple[str, ...] = ALL
    instance: Tuple[str, ...] = ALL
    namespace: Tuple[str, ...] = ALL
    pod: Tuple[str, ...] = ALL
    mount: Tuple[str, ...] = ALL
    own: Tuple[str, ...] = ()
    named: Tuple[str, ...] = ()
    nodes: Tuple[str, ...] = ()
    mounts: Optional[FrozenSet[str]] = field(default=None)  # None: every mount


SELECTIONS: Tuple[Selection, ...] = (
    Selection(name="a sidecar's pod", job=("shmwatch",), namespace=("llm",), pod=("vllm-0",), own=("vllm-0",)),
    Selection(
        name="one sidecar by its instance, one mount",
        job=("shmwatch",),
        instance=("10.0.0.5:9841",),
        mount=("/dev/shm",),
        own=("vllm-0",),
        mounts=frozenset({"/dev/shm"}),
    ),
    Selection(
        name="a node-mode pod",
        job=("shmwatch-node",),
        namespace=("llm",),
        pod=("sglang-1",),
        named=("A u1",),
        nodes=("A node",),
    ),
    Selection(
        name="a node-mode pod, one mount",
        job=("shmwatch-node",),
        namespace=("llm",),
        pod=("sglang-1",),
        mount=("dshm",),
        named=("A u1",),
        nodes=("A node",),
        mounts=frozenset({"dshm"}),
    ),
    Selection(
        name="one node, every pod",
        job=("shmwatch-node",),
        instance=("10.0.1.9:9841",),
        own=("A node", "A host"),
        named=("A u1", "A u3"),
        nodes=("A node",),
    ),
    Selection(
        name="a pod of each shape, one mount each",
        namespace=("llm",),
        pod=("vllm-0", "sglang-1"),
        mount=("/dev/shm", "dshm"),
        own=("vllm-0", "canary vllm-0"),
        named=("A u1", "canary u1"),
        nodes=("A node", "canary node"),
        mounts=frozenset({"/dev/shm", "dshm"}),
    ),
    *(
        Selection(
            name=f"a pod seen by its {way} only",
            job=("shmwatch-node",),
            instance=(target["instance"],),
            namespace=("llm",),
            pod=(PODS[uid][1],),
            named=(f"{node} {uid}",),
            nodes=(f"{node} node",),
        )
        for node, (target, uid, way) in PROBES.items()
    ),
    Selection(
        name="a pod of the canary DaemonSet",
        job=("shmwatch-node-canary",),
        pod=("sglang-1",),
        named=("canary u1",),
        nodes=("canary node",),
    ),
)


def grafana_regex(values: Tuple[str, ...]) -> str:
    """A multi-value variable as Grafana's Prometheus data source writes it into a query:
    All is the variable's allValue, one value is regex-escaped, several are (a|b)."""
    if not values:
        return ".*"
    escaped = [
        re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), v.replace("\\", "\\\\\\\\")) for v in values
    ]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, selection: Selection) -> str:
    for name, value in (
        ("$__rate_interval", RATE_INTERVAL),
        ("$job", grafana_regex(selection.job)),
        ("$instance", grafana_regex(selection.instance)),
        ("$namespace", grafana_regex(selection.namespace)),
        ("$pod", grafana_regex(selection.pod)),
        ("$mount", grafana_regex(selection.mount)),
    ):
        expr = expr.replace(name, value)
    if re.search(r"\$(?!\d)", expr):  # label_replace's $1 is not a variable
        raise ValueError(f"a variable the test does not set: {expr}")
    return expr


# ---- the dashboard's targets -------------------------------------------------------


@dataclass(frozen=True)
class Target:
    panel: str
    ref: str
    expr: str


def targets() -> List[Target]:
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    return [
        Target(panel=p["title"], ref=t["refId"], expr=t["expr"])
        for p in dashboard["panels"]
        if p["type"] != "row"
        for t in p.get("targets", [])
    ]


def scenarios_for(panel: str, ref: str, expr: str) -> List[Scenario]:
    """The checks of one query (expr in its place) for every selection, as one scenario."""
    from tests.rules.dashboard_expect import expected  # the expectations read this module

    checks = []
    for selection in SELECTIONS:
        samples = tuple(Sample(name=s.name, labels=s.labels, value=s.value) for s in expected(panel, ref, selection))
        checks.append(Equals(expr=substitute(expr, selection), at=AT, samples=samples))
    names = frozenset(metric_names(parse(substitute(expr, SELECTIONS[0]))))
    return [Scenario(name=f"{panel} {ref}", series=series_for(names), checks=tuple(checks))]
