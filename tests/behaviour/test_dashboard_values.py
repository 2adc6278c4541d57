"""Every query of the dashboard, with Grafana's variables set as a user sets them, returns
exactly the series and numbers it must, on a synthetic world of sidecars and node-mode
exporters (tests/rules/dashboard.py; what each query must make of it:
tests/rules/dashboard_expect.py). One promtool run for every query and selection.
bench/rule_mutation.py runs the same checks against mutated queries."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Set, Tuple

import pytest

from tests.rules import dashboard
from tests.rules.dashboard_expect import EXPECT
from tests.rules.promql import metric_names, parse, set_operators, show
from tests.rules.promtool import failing_scenarios, run, write_tests
from tests.rules.scenario import Equals, Scenario


def test_every_query_has_its_expectation() -> None:
    queries = {(t.panel, t.ref) for t in dashboard.targets()}
    assert len(queries) >= 45  # the dashboard reads only default families: 49 queries
    assert sorted(queries - set(EXPECT)) == [], "queries with no expectation in tests/rules/dashboard_expect.py"
    assert sorted(set(EXPECT) - queries) == [], "expectations of queries the dashboard does not have"


def test_every_query_returns_its_values_for_every_selection(tmp_path: Path) -> None:
    scenarios = [s for t in dashboard.targets() for s in dashboard.scenarios_for(t.panel, t.ref, t.expr)]
    files = write_tests(str(tmp_path), None, scenarios)
    outcome = run([f.path for f in files])
    if all(outcome.passed.values()):
        return
    broken = failing_scenarios(str(tmp_path), None, scenarios)
    pytest.fail("queries failing:\n  " + "\n  ".join(broken) + "\n" + outcome.output[-8000:])


def test_every_selection_shows_something_on_most_panels() -> None:
    """A selection that matches nothing would pass every query vacuously."""
    for selection in dashboard.SELECTIONS:
        shown = [key for key, expect in EXPECT.items() if expect(selection)]
        assert len(shown) >= 3, (selection.name, len(shown))
    assert min(sum(1 for e in EXPECT.values() if e(s)) for s in dashboard.SELECTIONS[:6]) >= 30


# Sides no selection can give alone, and why.
IMPOSSIBLE = {
    ("SysV segments vs kernel.shmmni D", "or", "left"): "vector(0) is never empty",
    ("Collectors A", "and", "right"): "every exporter reports its collectors' success",
    ("Collector duration A", "and", "right"): "every exporter reports its collectors' duration",
}
# The pods an exporter watches (a node's series show for a pod it watches): each `or` of
# these selects every pod of the exporters, whatever pod is selected, so its operands are
# never empty alone; the selections "a pod seen by its ... only" show a node's series for a
# pod each of them alone gives.
WATCHED = {"shmwatch_mount_size_bytes", "shmwatch_cgroup_memory_working_set_bytes", "shmwatch_sysv_segments"}


def operand_emptiness(tmp_path: Path, texts: Set[str]) -> Set[str]:
    """Which of the expressions return something: promtool is asked for nothing from each,
    and the ones it reports are not empty."""
    names = frozenset(n for text in texts for n in metric_names(parse(text)))
    checks = tuple(Equals(expr=text, at=dashboard.AT, samples=()) for text in sorted(texts))
    files = write_tests(
        str(tmp_path), None, [Scenario(name="operands", series=dashboard.series_for(names), checks=checks)]
    )
    outcome = run([f.path for f in files])
    found = {json.loads(q) for q in re.findall(r'expr: ("(?:[^"\\]|\\.)*"), time:', outcome.output)}
    assert found <= set(texts), f"promtool reported expressions the test did not ask: {sorted(found - set(texts))[:3]}"
    return found


@dataclass(frozen=True)
class Operator:
    query: str  # panel and refId
    index: int  # among the query's and/or/unless, as written
    op: str
    operands: Tuple[Tuple[str, str], ...]  # (left, right) for each selection, variables set


def set_operators_of_queries() -> List[Operator]:
    out = []
    for target in dashboard.targets():
        for index, node in enumerate(set_operators(parse(target.expr))):
            if metric_names(node) <= WATCHED:
                continue
            operands = tuple(
                (dashboard.substitute(show(node.left), s), dashboard.substitute(show(node.right), s))
                for s in dashboard.SELECTIONS
            )
            out.append(Operator(query=f"{target.panel} {target.ref}", index=index, op=node.op, operands=operands))
    return out


def sides_missing(operator: Operator, nonempty: Set[str]) -> List[str]:
    seen = {(left in nonempty, right in nonempty) for left, right in operator.operands}
    wanted = {"left": (True, False), "right": (False, True), "both": (True, True)}
    return [
        f"{operator.query}: {operator.op} #{operator.index}: {side}"
        for side, pair in wanted.items()
        if pair not in seen and (operator.query, operator.op, side) not in IMPOSSIBLE
    ]


def test_every_side_of_every_set_operator_is_exercised(tmp_path: Path) -> None:
    """For each and/or/unless of each query: a selection where only its left operand has
    series, one where only its right has, one where both have."""
    operators = set_operators_of_queries()
    nonempty = operand_emptiness(tmp_path, {text for o in operators for pair in o.operands for text in pair})
    missing = [line for o in operators for line in sides_missing(o, nonempty)]
    assert not missing, "set operators whose side no selection exercises:\n  " + "\n  ".join(missing)
