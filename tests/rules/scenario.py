"""Scenarios for promtool: synthetic input series and what the rules or a query must give.

A Scenario is one promtool test group: its input series, and checks of two kinds:
- Fires: an alert at a time, with the exact labels and value of every firing instance (the
  value through a test-only annotation, see tests/rules/promtool.py), or none;
- Equals: a PromQL expression (a recording rule's name, or a dashboard query) at a time, with
  the exact labels and value of every sample it returns, or none.

Values are computed in the scenario from its inputs, by hand, and compared exactly (promtool
compares floats as they are): a ratio is written as the division of the two inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Tuple, Union

Labels = Mapping[str, str]
# A promtool series selector (name{labels}) -> its values in promtool's notation ("1x60").
Series = Dict[str, str]
# Long enough for every `for:` and window the scenarios use, at one sample a minute.
SAMPLES = 400


def selector(name: str, labels: Labels) -> str:
    """name{a="1", b="2"}: the form promtool reads for input series and expected samples."""
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def const(value: float, count: int = SAMPLES) -> str:
    return f"{value!r}x{count}"


@dataclass(frozen=True)
class Alert:
    labels: Labels  # without alertname and severity: they are added from the rule
    value: float


@dataclass(frozen=True)
class Fires:
    alert: str
    at: str
    alerts: Tuple[Alert, ...] = ()  # () : the alert does not fire


@dataclass(frozen=True)
class Sample:
    name: str  # the result's __name__: "" where the expression drops it
    labels: Labels
    value: float


@dataclass(frozen=True)
class Equals:
    expr: str
    at: str
    samples: Tuple[Sample, ...] = ()  # () : the expression returns nothing


Check = Union[Fires, Equals]


@dataclass(frozen=True)
class Side:
    """Which side of a set operator a scenario exercises: rule (alert or record name), the
    operator's place among the expression's and/or/unless (0 = first written), and
    "left", "right" (only that side has series) or "both" (both, with different values)."""

    rule: str
    index: int
    side: str


@dataclass(frozen=True)
class Scenario:
    name: str
    series: Series
    checks: Tuple[Check, ...]
    covers: Tuple[Side, ...] = ()
    interval: str = "1m"  # between input samples
    evaluation: str = "1m"  # between rule evaluations
    # False: the alerts' values are not compared (an expression whose float result this
    # scenario cannot state exactly, e.g. a regression over a bent line); labels still are.
    values: bool = True


def merge(*parts: Series) -> Series:
    out: Series = {}
    for part in parts:
        duplicate = set(out) & set(part)
        if duplicate:
            raise ValueError(f"series given twice: {sorted(duplicate)}")
        out.update(part)
    return out


def only(mapping: Labels, *drop: str, **extra: str) -> Dict[str, str]:
    """A copy of a label set without some labels and with others set."""
    out = {k: v for k, v in mapping.items() if k not in drop}
    out.update(extra)
    return out


def fires(alert: str, at: str, *alerts: Tuple[Labels, float]) -> Fires:
    return Fires(alert=alert, at=at, alerts=tuple(Alert(labels=labels, value=value) for labels, value in alerts))


def equals(expr: str, at: str, *samples: Tuple[str, Labels, float]) -> Equals:
    return Equals(expr=expr, at=at, samples=tuple(Sample(name=n, labels=labels, value=v) for n, labels, v in samples))
