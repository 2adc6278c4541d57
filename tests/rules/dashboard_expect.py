"""What each dashboard query must return for a selection, from the world's numbers.

A query shows a metric's series of the sources the selection names (tests/rules/dashboard.py):
its own sources' series as stored; its named pods' series with the workload's namespace and
pod (and no metric name: the join's `*` drops it); the node series of the exporters that
watch a selected pod. EXPECT says, panel by panel, what the query makes of them (a maximum
by mount, a sum by class, an increase over an hour, used / total) and each value is computed
here from the synthetic inputs: a counter rising r a minute increases by 60 r in an hour
and has a rate of 4 r / 240 over Grafana's 4-minute $__rate_interval.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tests.rules.dashboard import AT_MINUTES, BY_KEY, PODS, WORLD, Point, Selection
from tests.rules.promtool import load_groups, rule_paths, rules_of


@dataclass(frozen=True)
class Shown:
    name: str  # "" where the query drops the metric name
    labels: Dict[str, str]
    value: float
    point: Optional[Point] = None  # the world's series it shows


Rows = List[Shown]
Expect = Callable[[Selection], Rows]


def _mount_ok(point: Point, selection: Selection) -> bool:
    """A mount is picked by its path, a node-mode pod's by its volume."""
    where = point.labels.get("mount", point.labels.get("volume"))
    return selection.mounts is None or where is None or where in selection.mounts


def _of(metric: str, sources: Sequence[str], where: Dict[str, str], selection: Selection) -> List[Point]:
    return [
        p
        for p in WORLD
        if p.metric == metric
        and p.source in sources
        and all(p.labels.get(k) == v for k, v in where.items())
        and _mount_ok(p, selection)
    ]


def _named(point: Point) -> Shown:
    namespace, pod = PODS[BY_KEY[point.source].uid]
    return Shown(
        name="", labels={**point.labels, "namespace": namespace, "pod": pod}, value=point.at(AT_MINUTES), point=point
    )


def _as_is(point: Point) -> Shown:
    return Shown(name=point.metric, labels=point.labels, value=point.at(AT_MINUTES), point=point)


def _union(*parts: Rows) -> Rows:
    """`or`: a later series with the same labels (but the name) as an earlier one is left out."""
    seen, out = set(), []
    for row in (r for part in parts for r in part):
        key = tuple(sorted(row.labels.items()))
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def pod_series(metric: str, **where: str) -> Expect:
    """A pod's metric: the selection's own series, and its named pods'."""
    return lambda s: _union(
        [_as_is(p) for p in _of(metric, s.own, where, s)], [_named(p) for p in _of(metric, s.named, where, s)]
    )


def node_series(metric: str, **where: str) -> Expect:
    """A node's metric: the selection's own series, and those of the nodes its pods are on."""
    return lambda s: _union(
        [_as_is(p) for p in _of(metric, s.own, where, s)], [_as_is(p) for p in _of(metric, s.nodes, where, s)]
    )


def aggregate(op: Callable[[List[float]], float], by: Tuple[str, ...], inner: Expect) -> Expect:
    def rows(s: Selection) -> Rows:
        groups: Dict[Tuple[Tuple[str, str], ...], List[float]] = {}
        for row in inner(s):
            key = tuple((k, row.labels[k]) for k in by if k in row.labels)
            groups.setdefault(key, []).append(row.value)
        return [Shown(name="", labels=dict(k), value=op(v)) for k, v in groups.items()]

    return rows


def _rise(row: Shown, minutes: int) -> float:
    """How much a counter rose over the last minutes (no reset; a sample at both ends of the
    window, so nothing is extrapolated)."""
    assert row.point is not None
    return row.point.at(AT_MINUTES) - row.point.at(AT_MINUTES - minutes)


def per_second(inner: Expect, minutes: int) -> Expect:
    """rate over a window of whole minutes: the counter's rise in it over its seconds."""
    return lambda s: [Shown(name="", labels=r.labels, value=_rise(r, minutes) / (minutes * 60)) for r in inner(s)]


def increase(inner: Expect, minutes: int) -> Expect:
    return lambda s: [Shown(name="", labels=r.labels, value=_rise(r, minutes)) for r in inner(s)]


def ratio(numerator: Expect, denominator: Expect) -> Expect:
    def rows(s: Selection) -> Rows:
        below = {tuple(sorted(r.labels.items())): r.value for r in denominator(s)}
        out = []
        for row in numerator(s):
            key = tuple(sorted(row.labels.items()))
            if key in below:
                out.append(Shown(name="", labels=row.labels, value=row.value / below[key]))
        return out

    return rows


def clamp_max(inner: Expect, most: float) -> Expect:
    return lambda s: [Shown(name="", labels=r.labels, value=min(r.value, most)) for r in inner(s)]


def zero_count_or_zero(inner: Expect) -> Expect:
    """count(x == 0) or vector(0): how many are 0, and 0 when none is."""

    def rows(s: Selection) -> Rows:
        zeros = [r for r in inner(s) if r.value == 0]
        return [Shown(name="", labels={}, value=float(len(zeros)))]

    return rows


def _cgroup_key(row: Shown) -> Tuple[str, ...]:
    """A cgroup: its path, or a node-mode pod's by its pod_uid."""
    return tuple(row.labels.get(k, "") for k in ("job", "instance", "cgroup", "pod_uid"))


def throttled_limits(s: Selection) -> Rows:
    """The limits of the cgroups memory.events ever counted throttled at memory.high."""
    limits = pod_series("shmwatch_cgroup_memory_limit_bytes")(s)
    events = pod_series("shmwatch_cgroup_memory_events_total", event="high")(s)
    throttled = {_cgroup_key(r) for r in events if r.value > 0}
    return [r for r in limits if _cgroup_key(r) in throttled]


def _shmwatch_alerts() -> frozenset[str]:
    return frozenset(n for n, r in rules_of(load_groups(rule_paths())).items() if "alert" in r)


def firing_alerts(s: Selection) -> Rows:
    """shmwatch's firing alerts of the selection's sources and named pods, and of the nodes
    its pods run on, counted by (alertname, severity, mount, volume)."""
    ours = _shmwatch_alerts()
    shown = _union(
        [_as_is(p) for p in _of("ALERTS", s.own, {"alertstate": "firing"}, _every_mount(s))],
        [_named(p) for p in _of("ALERTS", s.named, {"alertstate": "firing"}, _every_mount(s))],
        [_as_is(p) for p in _of("ALERTS", s.nodes, {"alertstate": "firing"}, _every_mount(s))],
    )
    mine = [r for r in shown if r.labels["alertname"] in ours]
    return aggregate(sum, ("alertname", "severity", "mount", "volume"), lambda _: mine)(s)


def _every_mount(s: Selection) -> Selection:
    """The alerts table has no mount filter."""
    return replace(s, mounts=None)


def total(inner: Expect) -> Expect:
    return aggregate(sum, (), inner)


def P(metric: str, **where: str) -> Expect:  # noqa: N802 (the dashboard's own name for it)
    return pod_series(metric, **where)


def N(metric: str) -> Expect:  # noqa: N802
    return node_series(metric)


GPU_USED, GPU_TOTAL = "shmwatch_gpu_memory_used_bytes", "shmwatch_gpu_memory_total_bytes"
MOUNT = ("mount", "volume")  # a mount: its path, or a node-mode pod's volume
EXPECT: Dict[Tuple[str, str], Expect] = {
    ("/dev/shm usage", "A"): aggregate(max, MOUNT, P("shmwatch:mount_usage_ratio")),
    ("OOM risk (working set / limit)", "A"): aggregate(max, ("cgroup",), P("shmwatch:oom_risk_ratio")),
    ("OOM risk (working set / limit)", "B"): aggregate(max, MOUNT, P("shmwatch_shm_oom_projection_ratio")),
    ("GPU memory used", "A"): ratio(N(GPU_USED), N(GPU_TOTAL)),
    ("Firing alerts", "A"): firing_alerts,
    ("Used, size, effective size, peak", "A"): P("shmwatch_mount_used_bytes"),
    ("Used, size, effective size, peak", "B"): P("shmwatch_mount_peak_used_bytes"),
    ("Used, size, effective size, peak", "C"): P("shmwatch_mount_size_bytes"),
    ("Used, size, effective size, peak", "D"): P("shmwatch_mount_effective_size_bytes"),
    ("Recommended vs configured size", "A"): P("shmwatch:mount_recommended_size_bytes"),
    ("Recommended vs configured size", "B"): P("shmwatch_mount_size_bytes"),
    ("Recommended vs configured size", "C"): P("shmwatch:mount_observed_peak_bytes"),
    ("Recommended vs configured size", "D"): P("shmwatch_mount_max_used_bytes"),
    ("Memory limit the recommendation needs", "A"): P("shmwatch:mount_recommended_memory_limit_bytes"),
    ("Memory limit the recommendation needs", "B"): P("shmwatch_cgroup_memory_limit_bytes"),
    ("Bytes by owner class", "A"): aggregate(sum, ("class",), P("shmwatch_segment_bytes")),
    ("Bytes by state", "A"): aggregate(sum, ("state",), P("shmwatch_segment_bytes")),
    ("Largest segments", "A"): P("shmwatch_top_segment_bytes"),
    ("Leaked and hidden", "A"): total(P("shmwatch_segments", state="orphan")),
    ("Leaked and hidden", "B"): total(P("shmwatch_segment_bytes", state="orphan")),
    ("Leaked and hidden", "C"): aggregate(max, (), P("shmwatch_orphan_oldest_age_seconds")),
    ("Leaked and hidden", "D"): total(P("shmwatch_segment_bytes", state="hidden")),
    ("Segments by class", "A"): aggregate(sum, ("class", "state"), P("shmwatch_segments")),
    ("Container memory: working set vs limit, with the shm part", "A"): P("shmwatch_cgroup_memory_working_set_bytes"),
    ("Container memory: working set vs limit, with the shm part", "B"): P("shmwatch_cgroup_memory_shmem_bytes"),
    ("Container memory: working set vs limit, with the shm part", "C"): P("shmwatch_cgroup_memory_limit_bytes"),
    ("OOM kills and projection", "A"): increase(P("shmwatch_cgroup_oom_kills_total"), 60),
    ("OOM kills and projection", "B"): P("shmwatch_shm_oom_projection_ratio"),
    ("Host memory", "A"): N("shmwatch_host_memory_total_bytes"),
    ("Host memory", "B"): N("shmwatch_host_memory_available_bytes"),
    ("Host memory", "C"): N("shmwatch_host_memory_shmem_bytes"),
    ("memory.high and the shm under it", "A"): P("shmwatch_cgroup_memory_high_bytes"),
    ("memory.high and the shm under it", "B"): throttled_limits,
    ("memory.high and the shm under it", "C"): P("shmwatch_cgroup_memory_shmem_bytes"),
    ("Memory events: throttling at memory.high", "A"): per_second(P("shmwatch_cgroup_memory_events_total"), 4),
    ("SysV segments vs kernel.shmmni", "A"): total(P("shmwatch_sysv_segments")),
    ("SysV segments vs kernel.shmmni", "B"): total(P("shmwatch_sysv_orphan_segments")),
    ("SysV segments vs kernel.shmmni", "C"): aggregate(max, (), P("shmwatch_sysv_limit_shmmni")),
    ("SysV segments vs kernel.shmmni", "D"): zero_count_or_zero(P("shmwatch_sysv_namespace_readable")),
    ("SysV bytes vs kernel.shmall", "A"): P("shmwatch_sysv_bytes"),
    ("SysV bytes vs kernel.shmall", "B"): clamp_max(P("shmwatch_sysv_limit_shmall_bytes"), 1e15),
    ("GPU memory per GPU", "A"): N(GPU_USED),
    ("GPU memory per GPU", "B"): N("shmwatch_gpu_memory_reserved_bytes"),
    ("GPU memory per GPU", "C"): N(GPU_TOTAL),
    ("GPU memory per process", "A"): N("shmwatch_gpu_process_memory_bytes"),
    ("Collectors", "A"): aggregate(min, ("collector",), N("shmwatch_collector_success")),
    ("Collector duration", "A"): aggregate(max, ("collector",), N("shmwatch_collector_duration_seconds")),
    ("/proc access", "A"): aggregate(max, (), N("shmwatch_proc_unreadable")),
    ("Inventory degraded", "A"): aggregate(max, MOUNT, P("shmwatch_inventory_degraded")),
}


def expected(panel: str, ref: str, selection: Selection) -> Rows:
    return EXPECT[(panel, ref)](selection)


def expectation(panel: str, ref: str) -> Optional[Expect]:
    return EXPECT.get((panel, ref))
