"""A small PromQL parser and printer for the expressions shmwatch ships.

The rules (deploy/prometheus/*.yml) and the dashboard's queries (grafana/shmwatch.json) as
trees: the rule tests ask which set operators an expression has, and bench/rule_mutation.py
changes one node and prints the tree back as PromQL. It reads what those files use:
selectors with matchers, range windows (Grafana's $__rate_interval included), function
calls, aggregations with by/without (before or after the parentheses), binary
operators with bool, on/ignoring and group_left/group_right, numbers, strings, parentheses
and unary signs. Subqueries, offsets and @ modifiers are refused (ParseError), not misread.

print(parse(text)) parses back to the same tree (tests/unit/rules/test_promql.py), with
parentheses added wherever the operators' precedence needs them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple, Union

AGGREGATORS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile"}
)
SET_OPERATORS = frozenset({"and", "or", "unless"})
COMPARISONS = frozenset({"==", "!=", ">", "<", ">=", "<="})
# Binary operators by precedence, lowest first (Prometheus' order); ^ is right-associative.
_PRECEDENCE = {
    "or": 1,
    "and": 2,
    "unless": 2,
    "==": 3,
    "!=": 3,
    ">": 3,
    "<": 3,
    ">=": 3,
    "<=": 3,
    "+": 4,
    "-": 4,
    "*": 5,
    "/": 5,
    "%": 5,
    "atan2": 5,
    "^": 6,
}
_TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<window>\[[^\]]*\])
    | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){},@])
    )""",
    re.X,
)


class ParseError(ValueError):
    """Text this parser does not read (bad PromQL, or a construct shmwatch does not use)."""


@dataclass(frozen=True)
class Number:
    text: str


@dataclass(frozen=True)
class String:
    text: str  # quotes included, as written


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # =, !=, =~ or !~
    value: str  # the quoted string, as written


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: Tuple[Matcher, ...] = ()
    window: Optional[str] = None  # between the brackets: "5m", "$__rate_interval"


@dataclass(frozen=True)
class Call:
    func: str
    args: Tuple["Node", ...]


@dataclass(frozen=True)
class Grouping:
    without: bool
    labels: Tuple[str, ...]


@dataclass(frozen=True)
class Aggregate:
    op: str
    expr: "Node"
    param: Optional["Node"] = None  # topk's k, quantile's q, count_values' label
    grouping: Optional[Grouping] = None


@dataclass(frozen=True)
class Matching:
    ignoring: bool  # on (False) or ignoring (True)
    labels: Tuple[str, ...]
    group: Optional[str] = None  # "group_left" or "group_right"
    include: Optional[Tuple[str, ...]] = None  # the labels after group_x; None: no list written


@dataclass(frozen=True)
class Binary:
    op: str
    left: "Node"
    right: "Node"
    bool_modifier: bool = False
    matching: Optional[Matching] = None


@dataclass(frozen=True)
class Paren:
    expr: "Node"


@dataclass(frozen=True)
class Unary:
    op: str
    expr: "Node"


Node = Union[Number, String, Selector, Call, Aggregate, Binary, Paren, Unary]


@dataclass(frozen=True)
class Token:
    kind: str  # string, window, number, ident, op, end
    text: str


def tokenize(text: str) -> Tuple[Token, ...]:
    tokens = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            if text[pos:].strip():
                raise ParseError(f"cannot read {text[pos : pos + 20]!r} at {pos}")
            break
        kind = match.lastgroup or ""
        tokens.append(Token(kind=kind, text=match.group(kind)))
        pos = match.end()
    return tuple(tokens) + (Token(kind="end", text=""),)


class _Parser:
    def __init__(self, text: str):
        self.tokens = tokenize(text)
        self.pos = 0

    def peek(self, ahead: int = 0) -> Token:
        return self.tokens[min(self.pos + ahead, len(self.tokens) - 1)]

    def take(self) -> Token:
        token = self.peek()
        self.pos += 1
        return token

    def expect(self, text: str) -> None:
        token = self.take()
        if token.text != text:
            raise ParseError(f"expected {text!r}, found {token.text!r}")

    def binary_operator(self) -> Optional[str]:
        token = self.peek()
        if token.kind == "op" and token.text in _PRECEDENCE:
            return token.text
        if token.kind == "ident" and token.text in _PRECEDENCE:
            return token.text
        return None

    def expression(self, min_precedence: int = 0) -> Node:
        left = self.unary()
        while True:
            op = self.binary_operator()
            if op is None or _PRECEDENCE[op] < min_precedence:
                return left
            self.take()
            bool_modifier = self.peek().text == "bool"
            if bool_modifier:
                self.take()
            matching = self.matching()
            right_associative = op == "^"
            right = self.expression(_PRECEDENCE[op] + (0 if right_associative else 1))
            left = Binary(op=op, left=left, right=right, bool_modifier=bool_modifier, matching=matching)

    def label_list(self) -> Tuple[str, ...]:
        self.expect("(")
        labels = []
        while self.peek().text != ")":
            token = self.take()
            if token.kind != "ident":
                raise ParseError(f"a label name, not {token.text!r}")
            labels.append(token.text)
            if self.peek().text == ",":
                self.take()
        self.expect(")")
        return tuple(labels)

    def matching(self) -> Optional[Matching]:
        if self.peek().text not in ("on", "ignoring"):
            if self.peek().text in ("group_left", "group_right"):
                raise ParseError("group_left/group_right needs on or ignoring")
            return None
        ignoring = self.take().text == "ignoring"
        labels = self.label_list()
        group = None
        include = None
        if self.peek().text in ("group_left", "group_right"):
            group = self.take().text
            if self.peek().text == "(":
                include = self.label_list()
        return Matching(ignoring=ignoring, labels=labels, group=group, include=include)

    def unary(self) -> Node:
        token = self.peek()
        if token.kind == "op" and token.text in ("-", "+"):
            self.take()
            # A sign binds tighter than every binary operator but ^.
            return Unary(op=token.text, expr=self.expression(_PRECEDENCE["^"]))
        return self.primary()

    def primary(self) -> Node:
        token = self.take()
        if token.kind == "number":
            return Number(text=token.text)
        if token.kind == "string":
            return String(text=token.text)
        if token.text == "(":
            inner = self.expression()
            self.expect(")")
            if self.peek().kind == "window":
                raise ParseError("subqueries are not read")
            return Paren(expr=inner)
        if token.kind == "ident":
            return self.named(token.text)
        raise ParseError(f"unexpected {token.text!r}")

    def named(self, name: str) -> Node:
        after = self.peek().text
        if name in AGGREGATORS and after in ("(", "by", "without"):
            return self.aggregate(name)
        if after == "(":
            return Call(func=name, args=self.arguments())
        return self.selector(name)

    def arguments(self) -> Tuple[Node, ...]:
        self.expect("(")
        args = []
        while self.peek().text != ")":
            args.append(self.expression())
            if self.peek().text == ",":
                self.take()
        self.expect(")")
        return tuple(args)

    def grouping(self) -> Optional[Grouping]:
        if self.peek().text not in ("by", "without"):
            return None
        without = self.take().text == "without"
        return Grouping(without=without, labels=self.label_list())

    def aggregate(self, op: str) -> Aggregate:
        grouping = self.grouping()
        args = self.arguments()
        grouping = grouping or self.grouping()
        if len(args) == 2:
            return Aggregate(op=op, expr=args[1], param=args[0], grouping=grouping)
        if len(args) != 1:
            raise ParseError(f"{op} takes one or two arguments")
        return Aggregate(op=op, expr=args[0], param=None, grouping=grouping)

    def selector(self, name: str) -> Selector:
        matchers = self.matchers() if self.peek().text == "{" else ()
        window = self.take().text[1:-1].strip() if self.peek().kind == "window" else None
        if window is not None and ":" in window:
            raise ParseError("subqueries are not read")
        if self.peek().text in ("offset", "@"):
            raise ParseError("offset and @ modifiers are not read")
        return Selector(name=name, matchers=matchers, window=window)

    def matchers(self) -> Tuple[Matcher, ...]:
        self.expect("{")
        found = []
        while self.peek().text != "}":
            label, op, value = self.take(), self.take(), self.take()
            if label.kind != "ident" or op.text not in ("=", "!=", "=~", "!~") or value.kind != "string":
                raise ParseError(f"bad matcher {label.text}{op.text}{value.text}")
            found.append(Matcher(label=label.text, op=op.text, value=value.text))
            if self.peek().text == ",":
                self.take()
        self.expect("}")
        return tuple(found)


def parse(text: str) -> Node:
    parser = _Parser(text)
    node = parser.expression()
    if parser.peek().kind != "end":
        raise ParseError(f"unexpected {parser.peek().text!r} after the expression")
    return node


def _labels(labels: Tuple[str, ...]) -> str:
    return "(" + ", ".join(labels) + ")"


def _matching_text(m: Matching) -> str:
    text = (" ignoring " if m.ignoring else " on ") + _labels(m.labels)
    if m.group:
        text += " " + m.group + ("" if m.include is None else " " + _labels(m.include))
    return text


def _operand(child: Node, parent_op: str, right_side: bool) -> str:
    """A binary operand, in parentheses where precedence would otherwise regroup it."""
    text = show(child)
    if not isinstance(child, Binary):
        return text
    mine, theirs = _PRECEDENCE[child.op], _PRECEDENCE[parent_op]
    right_associative = parent_op == "^"
    tie_breaks = mine == theirs and (right_side != right_associative)
    return f"({text})" if mine < theirs or tie_breaks else text


def _show_selector(node: Selector) -> str:
    text = node.name
    if node.matchers:
        text += "{" + ", ".join(f"{m.label}{m.op}{m.value}" for m in node.matchers) + "}"
    if node.window is not None:
        text += f"[{node.window}]"
    return text


def _show_aggregate(node: Aggregate) -> str:
    grouping = ""
    if node.grouping is not None:
        grouping = (" without " if node.grouping.without else " by ") + _labels(node.grouping.labels) + " "
    args = ([show(node.param)] if node.param is not None else []) + [show(node.expr)]
    return f"{node.op}{grouping}({', '.join(args)})"


def _show_binary(node: Binary) -> str:
    modifiers = (" bool" if node.bool_modifier else "") + (_matching_text(node.matching) if node.matching else "")
    left = _operand(node.left, node.op, right_side=False)
    right = _operand(node.right, node.op, right_side=True)
    return f"{left} {node.op}{modifiers} {right}"


def show(node: Node) -> str:
    """The tree as PromQL text."""
    if isinstance(node, (Number, String)):
        return node.text
    if isinstance(node, Selector):
        return _show_selector(node)
    if isinstance(node, Call):
        return f"{node.func}({', '.join(show(a) for a in node.args)})"
    if isinstance(node, Aggregate):
        return _show_aggregate(node)
    if isinstance(node, Binary):
        return _show_binary(node)
    if isinstance(node, Paren):
        return f"({show(node.expr)})"
    inner = show(node.expr)
    return f"{node.op}({inner})" if isinstance(node.expr, Binary) else f"{node.op}{inner}"


def children(node: Node) -> Iterator[Node]:
    if isinstance(node, Binary):
        yield node.left
        yield node.right
    elif isinstance(node, Aggregate):
        if node.param is not None:
            yield node.param
        yield node.expr
    elif isinstance(node, Call):
        yield from node.args
    elif isinstance(node, (Paren, Unary)):
        yield node.expr


def walk(node: Node) -> Iterator[Node]:
    """Every node, parents before their children, left to right."""
    yield node
    for child in children(node):
        yield from walk(child)


def metric_names(node: Node) -> frozenset[str]:
    return frozenset(n.name for n in walk(node) if isinstance(n, Selector))


def set_operators(node: Node) -> Tuple[Binary, ...]:
    """The and/or/unless nodes, in the order they are written."""
    return tuple(n for n in _in_order(node) if isinstance(n, Binary) and n.op in SET_OPERATORS)


def _in_order(node: Node) -> Iterator[Node]:
    if isinstance(node, Binary):
        yield from _in_order(node.left)
        yield node
        yield from _in_order(node.right)
        return
    yield node
    for child in children(node):
        yield from _in_order(child)
