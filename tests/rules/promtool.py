"""Scenarios run by promtool: the shipped rules as a test copy, test files, one run for many.

The rules are read generically from every rule file in deploy/prometheus/ (what render.py
writes there), so a new rule file or group is tested without a change here. In the test copy
each alert's annotations are replaced by one, `value`, that prints the alert's value with 17
significant digits: promtool compares annotations, so a check states the alert's exact value
(the side of an `and` it came from, the limit it was divided by). The real annotations are
checked rendered elsewhere (tests/system/test_alerting_live.py, tests/rules/recommend_test.yml).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import yaml

from tests.rules.scenario import Equals, Fires, Scenario, selector

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES_DIR = os.path.join(REPO, "deploy", "prometheus")
VALUE_ANNOTATION = '{{ printf "%.17g" $value }}'

Group = Dict[str, Any]


def rule_paths(directory: str = RULES_DIR) -> List[str]:
    """Every file of the directory that holds rule groups (prometheus.yml does not)."""
    found = []
    for path in sorted(glob.glob(os.path.join(directory, "*.yml"))):
        with open(path) as f:
            doc = yaml.safe_load(f)
        if isinstance(doc, dict) and "groups" in doc:
            found.append(path)
    return found


def load_groups(paths: Iterable[str]) -> List[Group]:
    groups: List[Group] = []
    for path in paths:
        with open(path) as f:
            groups += yaml.safe_load(f)["groups"]
    return groups


def rules_of(groups: Sequence[Group]) -> Dict[str, Dict[str, Any]]:
    """Alert or record name -> its rule."""
    return {r.get("alert") or r["record"]: r for g in groups for r in g["rules"]}


def for_tests(groups: Sequence[Group], values: bool) -> List[Group]:
    """The groups with each alert's annotations replaced by its value (or by none)."""
    out = []
    for group in groups:
        rules = []
        for rule in group["rules"]:
            rule = {k: v for k, v in rule.items() if k != "annotations"}
            if "alert" in rule and values:
                rule["annotations"] = {"value": VALUE_ANNOTATION}
            rules.append(rule)
        out.append({**group, "rules": rules})
    return out


def _expected_alerts(check: Fires, severity: str, values: bool) -> List[Dict[str, Any]]:
    out = []
    for alert in check.alerts:
        expected: Dict[str, Any] = {"exp_labels": {**alert.labels, "severity": severity}}
        if values:
            expected["exp_annotations"] = {"value": "%.17g" % alert.value}
        out.append(expected)
    return out


def _expr_test(check: Equals) -> Dict[str, Any]:
    return {
        "expr": check.expr,
        "eval_time": check.at,
        "exp_samples": [{"labels": selector(s.name, s.labels), "value": s.value} for s in check.samples],
    }


def as_test_group(scenario: Scenario, severities: Dict[str, str]) -> Dict[str, Any]:
    """One scenario as a promtool test group."""
    group: Dict[str, Any] = {
        "interval": scenario.interval,
        "input_series": [{"series": s, "values": v} for s, v in scenario.series.items()],
    }
    alerts = [c for c in scenario.checks if isinstance(c, Fires)]
    exprs = [c for c in scenario.checks if isinstance(c, Equals)]
    if alerts:
        group["alert_rule_test"] = [
            {
                "eval_time": c.at,
                "alertname": c.alert,
                "exp_alerts": _expected_alerts(c, severities[c.alert], scenario.values),
            }
            for c in alerts
        ]
    if exprs:
        group["promql_expr_test"] = [_expr_test(c) for c in exprs]
    return group


def severities_of(groups: Sequence[Group]) -> Dict[str, str]:
    return {r["alert"]: r.get("labels", {}).get("severity", "") for g in groups for r in g["rules"] if "alert" in r}


@dataclass(frozen=True)
class WrittenTests:
    path: str
    scenarios: Tuple[Scenario, ...]


def write_tests(
    workdir: str,
    groups: Optional[Sequence[Group]],
    scenarios: Sequence[Scenario],
    stem: str = "t",
    rules_stem: str = "",
) -> List[WrittenTests]:
    """Test files for the scenarios (one per evaluation interval and value mode), with the
    rules they read written beside them (once per rules_stem); groups None: no rules
    (dashboard queries)."""
    severities = severities_of(groups or [])
    batches: Dict[Tuple[str, bool], List[Scenario]] = {}
    for scenario in scenarios:
        batches.setdefault((scenario.evaluation, scenario.values), []).append(scenario)
    files = []
    for i, ((evaluation, values), batch) in enumerate(sorted(batches.items())):
        doc: Dict[str, Any] = {"evaluation_interval": evaluation, "rule_files": []}
        if groups is not None:
            rules_path = os.path.join(workdir, f"{rules_stem or stem}-rules-{int(values)}.yml")
            if not os.path.exists(rules_path):
                with open(rules_path, "w") as f:
                    yaml.safe_dump({"groups": for_tests(groups, values)}, f)
            doc["rule_files"] = [rules_path]
        doc["tests"] = [as_test_group(s, severities) for s in batch]
        path = os.path.join(workdir, f"{stem}-{i}.yml")
        with open(path, "w") as f:
            yaml.safe_dump(doc, f, width=1 << 16)
        files.append(WrittenTests(path=path, scenarios=tuple(batch)))
    return files


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        raise RuntimeError("promtool is not installed (Debian's 'prometheus'; .ci/run installs it)")
    return found


@dataclass(frozen=True)
class Outcome:
    passed: Dict[str, bool]  # test file -> every test in it passed
    output: str


def run(paths: Sequence[str], timeout: float = 300) -> Outcome:
    """One promtool run over many test files; which of them passed, from its report."""
    result = subprocess.run([promtool(), "test", "rules", *paths], capture_output=True, text=True, timeout=timeout)
    passed = {path: False for path in paths}
    for chunk in result.stdout.split("Unit Testing: ")[1:]:
        head, _, rest = chunk.partition("\n")
        passed[head.strip()] = rest.lstrip().startswith("SUCCESS")
    return Outcome(passed=passed, output=result.stdout + result.stderr)


def failing_scenarios(workdir: str, groups: Optional[Sequence[Group]], scenarios: Sequence[Scenario]) -> List[str]:
    """The names of the scenarios that fail, each run alone (after a failed run of all)."""
    files = [
        (s.name, f)
        for i, s in enumerate(scenarios)
        for f in write_tests(workdir, groups, [s], stem=f"one{i}", rules_stem="one")
    ]
    outcome = run([f.path for _, f in files])
    return [name for name, f in files if not outcome.passed[f.path]]
