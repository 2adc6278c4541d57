"""tests/rules/promql.py: every shipped expression reads back as the tree it printed, and
the printer puts back the parentheses that precedence needs after a tree is changed."""

from __future__ import annotations

import json
import os
from typing import List

import pytest

from tests.rules.promql import Binary, Paren, ParseError, Selector, parse, set_operators, show
from tests.rules.promtool import REPO, load_groups, rule_paths


def shipped_expressions() -> List[str]:
    exprs = [r["expr"] for g in load_groups(rule_paths()) for r in g["rules"]]
    with open(os.path.join(REPO, "grafana", "shmwatch.json")) as f:
        dashboard = json.load(f)
    exprs += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return exprs


def test_every_shipped_expression_prints_back_to_the_same_tree() -> None:
    exprs = shipped_expressions()
    assert len(exprs) > 80
    for expr in exprs:
        tree = parse(expr)
        assert parse(show(tree)) == tree, expr


def test_precedence_survives_a_swap() -> None:
    tree = parse("a - b - c")
    assert isinstance(tree, Binary)
    swapped = Binary(op=tree.op, left=tree.right, right=tree.left)
    assert show(swapped) == "c - (a - b)"
    assert show(parse("a or b and c")) == "a or b and c"
    assert show(Binary(op="and", left=parse("a or b"), right=parse("c"))) == "(a or b) and c"
    assert show(parse("2 ^ 3 ^ 2")) == "2 ^ 3 ^ 2"


def test_modifiers_and_lists_are_kept() -> None:
    text = 'x / on (a, b) group_left () (max by (a) (y{k=~"v.*", l!=""}) or z) > bool 0.5'
    tree = parse(text)
    assert parse(show(tree)) == tree
    assert [n.op for n in set_operators(tree)] == ["or"]
    assert 'group_left () (max by (a) (y{k=~"v.*", l!=""}) or z)' in show(tree)
    rate = parse("rate(x[$__rate_interval])")
    assert show(rate) == "rate(x[$__rate_interval])"
    assert parse("(x)") == Paren(expr=Selector(name="x"))


@pytest.mark.parametrize(
    "text", ["rate(x[5m:1m])", "(x)[5m:]", "x offset 5m", "x @ 100", "x and group_left y", "sum(", "x{a=1}"]
)
def test_what_it_does_not_read_is_refused(text: str) -> None:
    with pytest.raises(ParseError):
        parse(text)
