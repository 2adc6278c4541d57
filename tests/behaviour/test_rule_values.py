"""Every alert and recording rule, run by promtool on synthetic series, held to exact values.

The scenarios (tests/rules/shm_alerts.py, memory_alerts.py, records.py) give each alert a
case that fires, with its exact labels and value, and cases that stay quiet; each recording
rule its exact samples; and each and/or/unless each side alone and both sides with different
values (the side that must win shows). The rules are read from every rule file in
deploy/prometheus/, as rendered from the mixin: a new rule without scenarios fails here.
bench/rule_mutation.py runs the same scenarios against mutated copies of the rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

from tests.rules import memory_alerts, records, shm_alerts
from tests.rules.promql import parse, set_operators
from tests.rules.promtool import failing_scenarios, load_groups, rule_paths, rules_of, run, write_tests
from tests.rules.scenario import Equals, Fires, Scenario, Side

# Sides of a set operator no input can give alone, and why.
IMPOSSIBLE: Dict[Side, str] = {
    Side(
        rule="shmwatch:kube_pod_memory_limit_bytes", index=0, side="right"
    ): "a pod with memory limits to count has them to sum",
    Side(
        rule="shmwatch:mount_recommended_size_bytes", index=0, side="right"
    ): "the GiB rounding exists wherever the peak does",
    Side(
        rule="shmwatch:mount_recommended_size_bytes", index=1, side="left"
    ): "the MiB rounding exists wherever the peak does",
}


def scenarios() -> Tuple[Scenario, ...]:
    return shm_alerts.scenarios() + memory_alerts.scenarios() + records.scenarios()


def test_every_scenario_gives_its_values(tmp_path: Path) -> None:
    groups = load_groups(rule_paths())
    all_scenarios = scenarios()
    files = write_tests(str(tmp_path), groups, all_scenarios)
    outcome = run([f.path for f in files])
    if all(outcome.passed.values()):
        return
    broken = failing_scenarios(str(tmp_path), groups, all_scenarios)
    pytest.fail("scenarios failing:\n  " + "\n  ".join(broken) + "\n" + outcome.output[-6000:])


def test_every_alert_has_a_firing_and_a_quiet_scenario() -> None:
    rules = rules_of(load_groups(rule_paths()))
    checks = [c for s in scenarios() for c in s.checks if isinstance(c, Fires)]
    alerts = sorted(name for name, rule in rules.items() if "alert" in rule)
    missing = [a for a in alerts if not any(c.alert == a and c.alerts for c in checks)]
    missing += [f"{a} (quiet)" for a in alerts if not any(c.alert == a and not c.alerts for c in checks)]
    assert not missing, f"alerts without a firing or a quiet scenario: {missing}"
    assert not {c.alert for c in checks} - set(alerts), "scenarios for alerts the rules do not have"


def test_every_recording_rule_has_its_values_checked() -> None:
    rules = rules_of(load_groups(rule_paths()))
    checked: Set[str] = set()
    for scenario in scenarios():
        for check in scenario.checks:
            if isinstance(check, Equals) and check.samples:
                checked.add(check.expr)
    missing = sorted(name for name, rule in rules.items() if "record" in rule and name not in checked)
    assert not missing, f"recording rules with no value check: {missing}"


def test_every_side_of_every_set_operator_is_covered() -> None:
    rules = rules_of(load_groups(rule_paths()))
    covered = {side for s in scenarios() for side in s.covers}
    missing: List[str] = []
    for name, rule in rules.items():
        for index, node in enumerate(set_operators(parse(rule["expr"]))):
            for side in ("left", "right", "both"):
                wanted = Side(rule=name, index=index, side=side)
                if wanted not in covered and wanted not in IMPOSSIBLE:
                    missing.append(f"{name}: {node.op} #{index}, {side}")
    assert not missing, "set operators whose sides no scenario exercises:\n  " + "\n  ".join(missing)
    stale = [side for side in covered | set(IMPOSSIBLE) if side.rule not in rules]
    assert not stale, f"covers name rules that do not exist: {stale}"
