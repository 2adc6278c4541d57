#!/usr/bin/env python3
"""PromQL mutation testing of shmwatch's alerts, recording rules and dashboard queries.

    python3 bench/rule_mutation.py [--jobs 2] [--only NAME] [--kinds metric,number]

Reads every rule of deploy/prometheus/*.yml and every query of grafana/shmwatch.json (as
rendered from deploy/mixin), changes one thing in one expression at a time, and runs the
value tests against the changed copy (in a temporary directory; the repository is not
touched): a mutant whose tests all still pass survives. The tests are the scenarios of
tests/rules/ (what tests/behaviour/test_rule_values.py and test_dashboard_values.py run):
for a rule, those whose checks read it, directly or through another rule; for a query, its
own checks, with the mutant as the query.

Mutations (KINDS): the operands of and/or/unless swapped; a function for a sibling (rate,
increase, irate; the *_over_time ones; clamp_min/clamp_max; ceil/floor/round); a comparison
flipped; a number moved (x 0.9, x 1.1; 0 to 1 and -1); a range window halved and doubled;
a label matcher dropped; a metric for a sibling from exporter/model/catalogue.py (same
type and unit, same family after shmwatch_, any other ratio) or a recorded one; by for
without (and back); on for ignoring; group_left/group_right dropped; an on/ignoring clause
dropped; an aggregation for a sibling (sum, max, min, avg, count); a label dropped from a
by/without list. Mutants promtool does not accept (`promtool check rules`) are not counted; nor
those in EQUIVALENT, each with its reason. Prints a table per expression, the survivors,
a table per kind, the runtime, and last `N/M rule mutants killed (P %)`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from exporter.model.catalogue import BY_NAME, CATALOGUE, node_labels  # noqa: E402
from tests.rules import dashboard, memory_alerts, records, shm_alerts  # noqa: E402
from tests.rules.promql import (  # noqa: E402
    SET_OPERATORS,
    Aggregate,
    Binary,
    Call,
    Matcher,
    Node,
    Number,
    Paren,
    Selector,
    Unary,
    children,
    metric_names,
    parse,
    show,
)
from tests.rules.promtool import (
    Group,
    load_groups,
    promtool,
    rule_paths,
    rules_of,
    run,
    write_tests,
)  # noqa: E402
from tests.rules.scenario import Equals, Fires, Scenario  # noqa: E402

KINDS = (
    "swap-operands",
    "function",
    "comparison",
    "number",
    "window",
    "matcher",
    "metric",
    "by-without",
    "aggregation",
    "grouping-label",
    "on-ignoring",
    "group-modifier",
    "on-clause",
)
FUNCTION_FAMILIES = (
    ("rate", "increase", "irate"),
    ("max_over_time", "min_over_time", "avg_over_time", "last_over_time"),
    ("clamp_min", "clamp_max"),
    ("ceil", "floor", "round"),
)
AGGREGATIONS = ("sum", "max", "min", "avg", "count")
FLIPS = {
    ">": (">=", "<"),
    ">=": (">", "<="),
    "<": ("<=", ">"),
    "<=": ("<", ">="),
    "==": ("!=",),
    "!=": ("==",),
}
Path = Tuple[int, ...]


@dataclass(frozen=True)
class Target:
    """An expression under test: a rule (by name) or a dashboard query (panel and refId)."""

    name: str
    expr: str
    rule: bool


@dataclass(frozen=True)
class Change:
    """One change at one node: its kind, what it does, the node after it."""

    kind: str
    detail: str
    node: Node
    dropped: Optional[Matcher] = None  # the matcher a "matcher" change removes


@dataclass(frozen=True)
class Mutant:
    target: Target
    change: Change
    text: str
    ancestors: Tuple[Node, ...]  # from the root down to the changed node's parent
    site: Node

    @property
    def kind(self) -> str:
        return self.change.kind

    @property
    def detail(self) -> str:
        return self.change.detail


# ---- mutation operators ------------------------------------------------------------


def with_children(node: Node, kids: Sequence[Node]) -> Node:
    if isinstance(node, Binary):
        return replace(node, left=kids[0], right=kids[1])
    if isinstance(node, Aggregate):
        return (
            replace(node, param=kids[0], expr=kids[1])
            if node.param is not None
            else replace(node, expr=kids[0])
        )
    if isinstance(node, Call):
        return replace(node, args=tuple(kids))
    if isinstance(node, (Paren, Unary)):
        return replace(node, expr=kids[0])
    return node


def sites(node: Node, path: Path = ()) -> Iterator[Tuple[Path, Node]]:
    yield path, node
    for i, child in enumerate(children(node)):
        yield from sites(child, path + (i,))


def replaced(node: Node, path: Path, new: Node) -> Node:
    if not path:
        return new
    kids = list(children(node))
    kids[path[0]] = replaced(kids[path[0]], path[1:], new)
    return with_children(node, kids)


def ancestors_of(node: Node, path: Path) -> Tuple[Node, ...]:
    out = []
    for step in path:
        out.append(node)
        node = list(children(node))[step]
    return tuple(out)


def moved(text: str) -> List[str]:
    value = float(text)
    targets = (1.0, -1.0) if value == 0 else (value * 0.9, value * 1.1)
    return ["%.12g" % v for v in targets]


def window_moves(window: str) -> List[str]:
    if not window or "$" in window:
        return []
    seconds = sum(
        int(n) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[u]
        for n, u in re.findall(r"(\d+)([smhdw])", window)
    )
    return [f"{seconds // 2}s", f"{seconds * 2}s"]


def binary_mutations(node: Binary) -> Iterator[Change]:
    if node.op in SET_OPERATORS:
        yield Change(
            kind="swap-operands",
            detail=f"`{node.op}` operands swapped",
            node=replace(node, left=node.right, right=node.left),
        )
    for flip in FLIPS.get(node.op, ()):
        yield Change(
            kind="comparison",
            detail=f"`{node.op}` -> `{flip}`",
            node=replace(node, op=flip),
        )
    m = node.matching
    if m is None:
        return
    clause = f"`{'ignoring' if m.ignoring else 'on'} ({', '.join(m.labels)})`"
    yield Change(
        kind="on-ignoring",
        detail=f"{clause} flipped",
        node=replace(node, matching=replace(m, ignoring=not m.ignoring)),
    )
    if m.group:
        yield Change(
            kind="group-modifier",
            detail=f"`{m.group}` dropped",
            node=replace(node, matching=replace(m, group=None, include=None)),
        )
    yield Change(
        kind="on-clause", detail=f"{clause} dropped", node=replace(node, matching=None)
    )


def selector_mutations(
    node: Selector, siblings: Dict[str, Tuple[str, ...]]
) -> Iterator[Change]:
    for i, matcher in enumerate(node.matchers):
        kept = node.matchers[:i] + node.matchers[i + 1 :]
        detail = f"{node.name}: `{matcher.label}{matcher.op}{matcher.value}` dropped"
        yield Change(
            kind="matcher",
            detail=detail,
            node=replace(node, matchers=kept),
            dropped=matcher,
        )
    for other in siblings.get(node.name, ()):
        yield Change(
            kind="metric",
            detail=f"{node.name} -> {other}",
            node=replace(node, name=other),
        )
    for window in window_moves(node.window or ""):
        yield Change(
            kind="window",
            detail=f"{node.name}[{node.window}] -> [{window}]",
            node=replace(node, window=window),
        )


def function_mutations(node: Call) -> Iterator[Change]:
    for family in FUNCTION_FAMILIES:
        for other in family if node.func in family else ():
            if other != node.func:
                yield Change(
                    kind="function",
                    detail=f"{node.func} -> {other}",
                    node=replace(node, func=other),
                )


def aggregate_mutations(node: Aggregate) -> Iterator[Change]:
    for other in AGGREGATIONS if node.op in AGGREGATIONS else ():
        if other != node.op:
            yield Change(
                kind="aggregation",
                detail=f"{node.op} -> {other}",
                node=replace(node, op=other),
            )
    g = node.grouping
    if g is None:
        return
    words = ("without", "by") if g.without else ("by", "without")
    clause = f"{node.op} {words[0]} ({', '.join(g.labels)})"
    yield Change(
        kind="by-without",
        detail=f"{clause} -> {words[1]}",
        node=replace(node, grouping=replace(g, without=not g.without)),
    )
    for label in g.labels:
        kept = tuple(x for x in g.labels if x != label)
        yield Change(
            kind="grouping-label",
            detail=f"{clause}: {label} dropped",
            node=replace(node, grouping=replace(g, labels=kept)),
        )


def local_mutations(
    node: Node, siblings: Dict[str, Tuple[str, ...]]
) -> Iterator[Change]:
    if isinstance(node, Binary):
        yield from binary_mutations(node)
    elif isinstance(node, Selector):
        yield from selector_mutations(node, siblings)
    elif isinstance(node, Number):
        for text in moved(node.text):
            yield Change(
                kind="number", detail=f"{node.text} -> {text}", node=Number(text=text)
            )
    elif isinstance(node, Call):
        yield from function_mutations(node)
    elif isinstance(node, Aggregate):
        yield from aggregate_mutations(node)


def mutants(target: Target, siblings: Dict[str, Tuple[str, ...]]) -> List[Mutant]:
    tree = parse(target.expr)
    out: Dict[str, Mutant] = {}
    original = show(tree)
    for path, node in sites(tree):
        for change in local_mutations(node, siblings):
            text = show(replaced(tree, path, change.node))
            if text != original and text not in out:
                out[text] = Mutant(
                    target=target,
                    change=change,
                    text=text,
                    ancestors=ancestors_of(tree, path),
                    site=node,
                )
    return list(out.values())


# ---- siblings ----------------------------------------------------------------------


def unit_of(name: str) -> str:
    base = name.removesuffix("_total")
    return next(
        (u for u in ("bytes", "seconds", "ratio") if base.endswith("_" + u)), ""
    )


def family_of(name: str) -> Tuple[str, ...]:
    """Metrics one copy-paste could confuse: same kind (exported or recorded), type and
    unit, and the same family (shmwatch_<family>_... or shmwatch:<family>_...); every
    exported ratio is a sibling of every other."""
    recorded = ":" in name
    kind = "counter" if name.endswith("_total") else "gauge"
    unit = unit_of(name)
    rest = name.split(":", 1)[1] if recorded else name.split("_", 1)[1]
    family = "*" if unit == "ratio" and not recorded else rest.split("_")[0]
    return (str(recorded), kind, unit, family)


def sibling_table(recorded: Sequence[str]) -> Dict[str, Tuple[str, ...]]:
    names = [m.name for m in CATALOGUE if m.name.startswith("shmwatch_")] + list(
        recorded
    )
    by_family: Dict[Tuple[str, ...], List[str]] = {}
    for name in names:
        by_family.setdefault(family_of(name), []).append(name)
    return {n: tuple(o for o in by_family[family_of(n)] if o != n) for n in names}


# ---- equivalent mutants --------------------------------------------------------------
# Each predicate names a pattern whose mutants give the same value as the original on every
# input the exporter's catalogue and the rules allow; the reason says why.

NODE_ALERTS = 'alertname=~"HostMemory.*|Gpu.*|Shmwatch.*"'
KUBE = "shmwatch:kube_pod_"


def _subtree(node: Node) -> List[Node]:
    out = [node]
    for child in children(node):
        out += _subtree(child)
    return out


def _side_of(m: Mutant, index: int) -> Tuple[Node, Node]:
    """At the ancestor `index`: (the operand holding the changed node, the other operand)."""
    parent = m.ancestors[index]
    below = m.ancestors[index + 1] if index + 1 < len(m.ancestors) else m.site
    assert isinstance(parent, Binary)
    return (
        (parent.left, parent.right)
        if below is parent.left
        else (parent.right, parent.left)
    )


def inside_pod_info_join(m: Mutant) -> bool:
    """The changed node is on the left of `... on (pod_uid) ... shmwatch:pod_info`."""
    for i, node in enumerate(m.ancestors):
        if (
            isinstance(node, Binary)
            and node.matching
            and node.matching.labels == ("pod_uid",)
        ):
            mine, other = _side_of(m, i)
            if mine is node.left and "shmwatch:pod_info" in metric_names(other):
                return True
    return False


def under_group(m: Mutant) -> bool:
    """The changed node is an `or` whose value only feeds `group by (...)` (through more `or`s)."""
    for node in reversed(m.ancestors):
        if isinstance(node, Aggregate):
            return node.op == "group"
        if not (
            isinstance(node, Paren) or (isinstance(node, Binary) and node.op == "or")
        ):
            return False
    return False


def _shape(node: Node) -> Optional[Selector]:
    """The selector of one shape of a dashboard series: itself, under rate/increase, or on the
    left of its join (`* on (pod_uid)`, `and on (job, instance)`); an `or` of shapes of one metric."""
    if isinstance(node, Paren):
        return _shape(node.expr)
    if isinstance(node, Selector):
        return node
    if (
        isinstance(node, Call)
        and node.func in ("rate", "increase", "irate")
        and node.args
    ):
        return _shape(node.args[0])
    joins = (("pod_uid",), ("job", "instance"))
    if (
        isinstance(node, Binary)
        and node.op in ("*", "and")
        and node.matching
        and node.matching.labels in joins
    ):
        return _shape(node.left)
    if isinstance(node, Binary) and node.op == "or":
        left, right = _shape(node.left), _shape(node.right)
        return (
            left
            if left is not None and right is not None and left.name == right.name
            else None
        )
    return None


def one_metric_two_shapes(m: Mutant) -> bool:
    if m.kind != "swap-operands" or not (
        isinstance(m.site, Binary) and m.site.op == "or"
    ):
        return False
    left, right = _shape(m.site.left), _shape(m.site.right)
    if left is None or right is None or left.name != right.name:
        return False
    return all(any(x.label == "pod_uid" for x in s.matchers) for s in (left, right))


def node_metric_pod_uid(m: Mutant) -> bool:
    """`pod_uid=""` on a metric the catalogue gives no pod_uid."""
    if m.change.dropped is None or (m.change.dropped.label, m.change.dropped.op) != (
        "pod_uid",
        "=",
    ):
        return False
    assert isinstance(m.site, Selector)
    metric = BY_NAME.get(m.site.name)
    return metric is not None and "pod_uid" not in node_labels(metric)


def node_alert_pod_uid(m: Mutant) -> bool:
    dropped = m.change.dropped
    if (
        dropped is None
        or (dropped.label, dropped.op) != ("pod_uid", "=")
        or not isinstance(m.site, Selector)
    ):
        return False
    return m.site.name == "ALERTS" and any(
        f"{x.label}{x.op}{x.value}" == NODE_ALERTS for x in m.site.matchers
    )


def implied_alertname(m: Mutant) -> bool:
    """The broad alertname matcher, beside the node alerts' narrower one."""
    dropped = m.change.dropped
    if (
        dropped is None
        or dropped.label != "alertname"
        or not isinstance(m.site, Selector)
    ):
        return False
    others = [f"{x.label}{x.op}{x.value}" for x in m.site.matchers if x != dropped]
    return (
        NODE_ALERTS in others
        and f"{dropped.label}{dropped.op}{dropped.value}" != NODE_ALERTS
    )


def matched_on_and_kept_across(m: Mutant) -> bool:
    """A matcher on a label an enclosing binary operator matches on (on (...)), which every
    series of its other operand carries too (shmwatch:pod_info aside: it only names)."""
    dropped = m.change.dropped
    if dropped is None:
        return False
    for i, node in enumerate(m.ancestors):
        if not (
            isinstance(node, Binary) and node.matching and not node.matching.ignoring
        ):
            continue
        if dropped.label not in node.matching.labels:
            continue
        _, other = _side_of(m, i)
        selectors = [
            x
            for x in _subtree(other)
            if isinstance(x, Selector) and x.name != "shmwatch:pod_info"
        ]
        if selectors and all(dropped in x.matchers for x in selectors):
            return True
    return False


@dataclass(frozen=True)
class Equivalent:
    reason: str
    matches: Callable[[Mutant], bool]


def aggregates_ones(m: Mutant) -> bool:
    """count for sum (or max, min, avg for each other) over series that are all 1."""
    if (
        m.kind != "aggregation"
        or not isinstance(m.site, Aggregate)
        or not isinstance(m.change.node, Aggregate)
    ):
        return False
    names = metric_names(m.site.expr)
    if not names or not all(n == "ALERTS" or n.endswith("_info") for n in names):
        return False
    pair = {m.site.op, m.change.node.op}
    return pair <= {"count", "sum"} or pair <= {"max", "min", "avg"}


EQUIVALENT = (
    Equivalent(
        reason='pod_uid!="" before a join with shmwatch:pod_info: the record has no empty pod_uid (its rule reads '
        'uid!="" through the regex (.+)), so a series without one joins nothing either way',
        matches=lambda m: (
            m.change.dropped is not None
            and f"{m.change.dropped.label}{m.change.dropped.op}" == "pod_uid!="
            and inside_pod_info_join(m)
        ),
    ),
    Equivalent(
        reason="`or` under group by (...): group keeps which label sets exist, and `or`'s union of them does not depend "
        "on the order (the operands carry different metric names)",
        matches=lambda m: (
            m.kind == "swap-operands"
            and isinstance(m.site, Binary)
            and m.site.op == "or"
            and under_group(m)
        ),
    ),
    Equivalent(
        reason="`or` of one metric's series in two shapes (pod_uid empty, or pods named by shmwatch:pod_info; a node's "
        "series directly or through the pods it watches): the shapes share no label set, or where they meet "
        "they are the same series with the same value, so the union does not depend on the order",
        matches=one_metric_two_shapes,
    ),
    Equivalent(
        reason='pod_uid="" on a metric exporter/model/catalogue.py gives no pod_uid (node_labels): no series of it has one',
        matches=node_metric_pod_uid,
    ),
    Equivalent(
        reason='pod_uid="" on ALERTS of HostMemory*, Gpu*, Shmwatch*: those alerts are computed from series with no '
        "pod_uid (host memory, GPUs, the exporter's own)",
        matches=node_alert_pod_uid,
    ),
    Equivalent(
        reason='alertname=~"Shm.*|Pod.*|..." beside alertname=~"HostMemory.*|Gpu.*|Shmwatch.*": every name the second '
        "admits, the first does",
        matches=implied_alertname,
    ),
    Equivalent(
        reason="a matcher on a label the enclosing operator matches on (on (job, instance ...)), which every series of "
        "the other operand carries too: a series it lets in has no partner there",
        matches=matched_on_and_kept_across,
    ),
    Equivalent(
        reason="used / total matches one to one on every label, and total is the same selection of its metric: a series "
        "a dropped matcher lets into one side has no partner on the other",
        matches=lambda m: m.target.name == "GPU memory used A" and m.kind == "matcher",
    ),
    Equivalent(
        reason="limit and on (job, instance, cgroup) throttled: both sides select the same workloads, and job, instance "
        "and cgroup name one workload (a sidecar's namespace and pod are its target's, a pod's cgroup is its own), "
        "so a namespace or pod matcher dropped on one side, or pod_uid on the side that only pairs, lets in "
        "nothing that pairs differently",
        matches=lambda m: (
            m.target.name == "memory.high and the shm under it B"
            and m.change.dropped is not None
            and (
                m.change.dropped.label in ("namespace", "pod")
                or (
                    m.change.dropped.label == "pod_uid"
                    and "events" in getattr(m.site, "name", "")
                )
            )
        ),
    ),
    Equivalent(
        reason="the aggregated series are all 1 (ALERTS, and *_info series: kube-state-metrics' and shmwatch's): count "
        "and sum agree, and so do max, min and avg",
        matches=aggregates_ones,
    ),
    Equivalent(
        reason="the firing alerts are counted by sum over ALERTS (always 1), times shmwatch:pod_info (always 1), or "
        "filtered by `and` (which keeps ALERTS' 1): sum and count agree",
        matches=lambda m: (
            m.target.name == "Firing alerts A" and m.detail == "sum -> count"
        ),
    ),
    Equivalent(
        reason="segment counts are never negative and only compared with > 0 (the alert's value is the mount's size): "
        "their sum, max and mean are above 0 together",
        matches=lambda m: (
            m.target.name == "ShmDockerDefaultSize"
            and m.detail in ("sum -> max", "sum -> avg")
        ),
    ),
    Equivalent(
        reason="a cgroup's memory.high and limit are one series per (instance, job, cgroup, pod_uid) (a pod's cgroup is "
        "named by its pod_uid; its target labels follow from them): the aggregation by those labels only drops labels, "
        "whichever it is",
        matches=lambda m: (
            m.target.name == "PodThrottledAtMemoryHigh"
            and m.detail in ("max -> sum", "max -> min", "max -> avg")
        ),
    ),
    Equivalent(
        reason="rate for increase on the right of `and ... > 0`: rate is increase over the window, `> 0` holds for both "
        "alike, and `and` keeps the left side's value",
        matches=lambda m: (
            m.target.name == "PodThrottledAtMemoryHigh"
            and m.detail == "increase -> rate"
        ),
    ),
    Equivalent(
        reason="at x * 1.25 = 1 GiB both roundings give 1 GiB, so >= and > agree on every peak",
        matches=lambda m: (
            m.target.name == "shmwatch:mount_recommended_size_bytes"
            and m.detail == "`>=` -> `>`"
        ),
    ),
    Equivalent(
        reason="clamp_min(..., 0) to -1 before ceil to a whole MiB: the recommended size is a whole MiB, and one byte "
        "less rounds up to it",
        matches=lambda m: (
            m.target.name == "shmwatch:mount_recommended_memory_limit_bytes"
            and m.detail == "0 -> -1"
        ),
    ),
    Equivalent(
        reason="both operands are records labelled exactly (namespace, pod): matching on them is matching on all",
        matches=lambda m: (
            m.target.name in (KUBE + "oom_risk_ratio", KUBE + "memory_limit_bytes")
            and m.detail == "`on (namespace, pod)` dropped"
        ),
    ),
    Equivalent(
        reason="both operands carry exactly (namespace, pod, mount): matching on them is matching on all",
        matches=lambda m: (
            m.target.name == KUBE + "shm_oom_projection_ratio"
            and m.detail == "`on (namespace, pod, mount)` dropped"
        ),
    ),
    Equivalent(
        reason='namespace!="" / pod!="" in the kube projection: the result is divided on (namespace, pod) by the limit '
        "record, whose pods kube-state-metrics always names, so a series without them is dropped there anyway",
        matches=lambda m: (
            m.target.name == KUBE + "shm_oom_projection_ratio"
            and m.change.dropped is not None
            and f"{m.change.dropped.label}{m.change.dropped.op}{m.change.dropped.value}"
            in ('namespace!=""', 'pod!=""')
        ),
    ),
)


def equivalent_reason(m: Mutant) -> Optional[str]:
    return next((e.reason for e in EQUIVALENT if e.matches(m)), None)


# ---- tests for a mutant ------------------------------------------------------------


def rule_scenarios() -> Tuple[Scenario, ...]:
    return shm_alerts.scenarios() + memory_alerts.scenarios() + records.scenarios()


def reads(groups: Sequence[Group]) -> Dict[str, Set[str]]:
    rules = rules_of(groups)
    return {
        name: set(metric_names(parse(r["expr"]))) & set(rules)
        for name, r in rules.items()
    }


def closure(names: Set[str], graph: Dict[str, Set[str]]) -> Set[str]:
    seen: Set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, set())
    return seen


def scenario_reads(scenario: Scenario, graph: Dict[str, Set[str]]) -> Set[str]:
    direct: Set[str] = set()
    for check in scenario.checks:
        if isinstance(check, Fires):
            direct.add(check.alert)
        elif isinstance(check, Equals):
            direct |= set(metric_names(parse(check.expr))) & set(graph)
    return closure(direct, graph)


def mutated_groups(groups: Sequence[Group], name: str, expr: str) -> List[Group]:
    out = []
    for group in groups:
        rules = [
            dict(r, expr=expr) if (r.get("alert") or r.get("record")) == name else r
            for r in group["rules"]
        ]
        out.append({**group, "rules": rules})
    return out


@dataclass
class Bench:
    groups: List[Group]
    scenarios: Tuple[Scenario, ...]
    graph: Dict[str, Set[str]]
    workdir: str

    def __post_init__(self) -> None:
        self.reads = [scenario_reads(s, self.graph) for s in self.scenarios]

    def relevant(self, name: str) -> List[Scenario]:
        """The scenarios with a check that reads the rule, directly or through another."""
        return [s for s, reads in zip(self.scenarios, self.reads) if name in reads]

    def files_for(self, index: int, target: Target, expr: str) -> List[str]:
        """Test files that run target's checks with expr in its place."""
        directory = os.path.join(self.workdir, str(index))
        os.makedirs(directory, exist_ok=True)
        if target.rule:
            groups = mutated_groups(self.groups, target.name, expr)
            return [
                f.path
                for f in write_tests(directory, groups, self.relevant(target.name))
            ]
        panel, ref = target.name.rsplit(" ", 1)
        return [
            f.path
            for f in write_tests(
                directory, None, dashboard.scenarios_for(panel, ref, expr)
            )
        ]


# ---- running -------------------------------------------------------------------------


def invalid_texts(texts: Sequence[str], workdir: str) -> Set[int]:
    """Indexes of the texts promtool does not accept as an expression."""
    rules = [
        {"record": f"m:{i}", "expr": dashboard.substitute(t, dashboard.SELECTIONS[0])}
        for i, t in enumerate(texts)
    ]
    path = os.path.join(workdir, "check.yml")
    with open(path, "w") as f:
        yaml.safe_dump({"groups": [{"name": "m", "rules": rules}]}, f, width=1 << 16)
    result = subprocess.run(
        [promtool(), "check", "rules", path], capture_output=True, text=True
    )
    return {
        int(n) - 1
        for n in re.findall(r'rule (\d+), "m:', result.stdout + result.stderr)
    }


def run_all(jobs: Dict[int, List[str]], workers: int) -> Dict[int, bool]:
    """Mutant index -> killed (some test file of it failed)."""
    items = [(i, path) for i, paths in jobs.items() for path in paths]
    chunks = [items[k : k + 40] for k in range(0, len(items), 40)]
    killed = {i: False for i in jobs}

    def one(chunk: List[Tuple[int, str]]) -> List[Tuple[int, bool]]:
        outcome = run([path for _, path in chunk], timeout=900)
        return [(i, not outcome.passed[path]) for i, path in chunk]

    with ThreadPoolExecutor(workers) as pool:
        for results in pool.map(one, chunks):
            for i, failed in results:
                killed[i] = killed[i] or failed
    return killed


def targets() -> List[Target]:
    out = [
        Target(name=name, expr=rule["expr"], rule=True)
        for name, rule in rules_of(load_groups(rule_paths())).items()
    ]
    out += [
        Target(name=f"{t.panel} {t.ref}", expr=t.expr, rule=False)
        for t in dashboard.targets()
    ]
    return out


@dataclass
class Tally:
    total: int = 0
    killed: int = 0
    invalid: int = 0
    equivalent: int = 0

    @property
    def survived(self) -> int:
        return self.total - self.killed


@dataclass
class Outcomes:
    found: List[Mutant]
    killed: Dict[int, bool]
    invalid: Set[int]
    equivalent: Dict[int, str]  # mutant index -> why it is excluded

    def count(self, i: int, tally: Tally) -> None:
        if i in self.invalid:
            tally.invalid += 1
        elif i in self.equivalent:
            tally.equivalent += 1
        else:
            tally.total += 1
            tally.killed += int(self.killed.get(i, False))

    def survivors(self) -> List[Mutant]:
        return [
            m
            for i, m in enumerate(self.found)
            if self.counts(i) and not self.killed.get(i)
        ]

    def counts(self, i: int) -> bool:
        return i not in self.invalid and i not in self.equivalent

    def wrongly_excluded(self) -> List[Mutant]:
        return [
            m
            for i, m in enumerate(self.found)
            if i in self.equivalent and self.killed.get(i)
        ]


def report(outcomes: Outcomes) -> Tally:
    per: Dict[str, Tally] = {}
    total = Tally()
    for i, m in enumerate(outcomes.found):
        outcomes.count(i, per.setdefault(m.target.name, Tally()))
        outcomes.count(i, total)
    print_table("expression", per)
    kinds: Dict[str, Tally] = {}
    for i, m in enumerate(outcomes.found):
        outcomes.count(i, kinds.setdefault(m.kind, Tally()))
    print()
    print_table("kind", kinds)
    return total


def print_table(title: str, rows: Dict[str, Tally]) -> None:
    width = max([len(n) for n in rows] + [len(title)])
    print(f"{title:<{width}}  mutants  killed  survived  invalid  equivalent")
    for name, t in rows.items():
        print(
            f"{name:<{width}}  {t.total:7d}  {t.killed:6d}  {t.survived:8d}  {t.invalid:7d}  {t.equivalent:10d}"
        )


def print_survivors(outcomes: Outcomes) -> None:
    survivors = outcomes.survivors()
    print(f"\nsurvivors ({len(survivors)}):")
    for m in survivors:
        print(f"  {m.target.name}: {m.kind}: {m.detail}")
    reasons: Dict[str, int] = {}
    for reason in outcomes.equivalent.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    print(f"\nexcluded as equivalent ({len(outcomes.equivalent)}):")
    for reason, count in reasons.items():
        print(f"  {count:4d}  {reason}")
    for m in outcomes.wrongly_excluded():
        print(
            f"EXCLUDED AS EQUIVALENT BUT KILLED: {m.target.name}: {m.kind}: {m.detail} ({equivalent_reason(m)})"
        )


def baseline_failures(bench: Bench, chosen: List[Target], workers: int) -> List[str]:
    """The targets whose tests fail with the expression as this script prints it, unchanged."""
    jobs = {
        i: bench.files_for(-1 - i, t, show(parse(t.expr))) for i, t in enumerate(chosen)
    }
    failed = run_all(jobs, workers)
    return [chosen[i].name for i, bad in failed.items() if bad]


def evaluate(
    groups: List[Group], chosen: List[Target], found: List[Mutant], workers: int
) -> Optional[Outcomes]:
    """Every mutant run against its tests; None when the tests fail unmutated."""
    with tempfile.TemporaryDirectory(prefix="rule-mutation-") as workdir:
        bench = Bench(groups, rule_scenarios(), reads(groups), workdir)
        broken = baseline_failures(bench, chosen, workers)
        if broken:
            print(
                "the tests fail on the unmutated expressions (as printed here): "
                + ", ".join(broken)
            )
            return None
        invalid = invalid_texts([m.text for m in found], workdir)
        equivalent = {
            i: r
            for i, m in enumerate(found)
            if i not in invalid
            for r in [equivalent_reason(m)]
            if r
        }
        # Equivalent mutants are run too: one that a test kills is not equivalent, and its
        # exclusion is wrong (reported, and the run fails).
        jobs = {
            i: bench.files_for(i, m.target, m.text)
            for i, m in enumerate(found)
            if i not in invalid
        }
        return Outcomes(
            found=found,
            killed=run_all(jobs, workers),
            invalid=invalid,
            equivalent=equivalent,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 2,
        help="promtool processes at once",
    )
    parser.add_argument(
        "--only", default="", help="only expressions whose name contains this"
    )
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help="mutation kinds, comma-separated"
    )
    args = parser.parse_args()
    started = time.monotonic()
    groups = load_groups(rule_paths())
    siblings = sibling_table(
        [name for name, r in rules_of(groups).items() if "record" in r]
    )
    chosen = [t for t in targets() if args.only in t.name]
    kinds = set(args.kinds.split(","))
    found = [m for t in chosen for m in mutants(t, siblings) if m.kind in kinds]
    outcomes = evaluate(groups, chosen, found, args.jobs)
    if outcomes is None:
        return 2
    total = report(outcomes)
    print_survivors(outcomes)
    print(
        f"\n{len(chosen)} expressions, {len(found)} mutants ({total.invalid} invalid, {total.equivalent} equivalent); "
        f"runtime {time.monotonic() - started:.0f} s with {args.jobs} promtool processes at once"
    )
    share = 100.0 * total.killed / total.total if total.total else 100.0
    print(f"{total.killed}/{total.total} rule mutants killed ({share:.1f} %)")
    return 1 if outcomes.wrongly_excluded() else 0


if __name__ == "__main__":
    sys.exit(main())
