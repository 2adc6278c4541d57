"""Metric families from the catalogue, with each sample's line of the text format.

A line is written as prometheus_client's generate_latest writes it (labels sorted by name,
values escaped, the value by floatToGoString), from one template per family, so a body is
the families' lines joined (render.py). The same line serves OpenMetrics 1.0.0 for the
gauges and counters made here (legacy names, no timestamps, exemplars or units).

A node's render has thousands of samples, and between two renders most mounts and cgroups
are as they were: `Families.part` keeps what each of them added, with the inputs it was
made from (`Memo`), and adds it again while the inputs are equal.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from exporter.model.catalogue import lookup, node_labels

Parts = Dict[str, Tuple[List[Sample], List[str]]]  # family name -> samples, their lines


class LineFormat:
    """One family's sample lines: `format(values, value)` with label values in the order
    of `names` (the catalogue's, node labels last) writes them sorted by label name."""

    def __init__(self, sample_name: str, names: Sequence[str]):
        self.order = sorted(range(len(names)), key=names.__getitem__)
        pairs = ",".join(f'{names[i]}="%s"' for i in self.order)
        self.template = sample_name + ("{" + pairs + "}" if names else "") + " %s\n"

    def format(self, values: Sequence[str], value: float) -> str:
        joined = "".join(values)
        if "\\" in joined or "\n" in joined or '"' in joined:  # rare: escape each
            values = [escape(v) for v in values]
        ordered = [values[i] for i in self.order]
        return self.template % (*ordered, floatToGoString(value))


def escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class Shape(NamedTuple):
    """What every sample of one family needs, looked up once per name and mode."""

    kind: type
    help: str
    labelnames: Tuple[str, ...]
    added: Tuple[str, ...]  # the labels node mode adds
    sample_name: str  # a counter's with _total
    line: LineFormat


@functools.lru_cache(maxsize=None)
def shape(name: str, node_mode: bool) -> Shape:
    entry = lookup(name)
    added = node_labels(entry) if node_mode else ()
    kind = CounterMetricFamily if entry.type == "counter" else GaugeMetricFamily
    labelnames = tuple(entry.labels) + tuple(added)
    sample_name = kind(name, entry.help).name
    sample_name += "_total" if kind is CounterMetricFamily else ""
    line = LineFormat(sample_name, labelnames)
    return Shape(kind, entry.help, labelnames, tuple(added), sample_name, line)


class Memo:
    """What each part of the last render added, by part, with the inputs it was made from.
    Only what the current render used is kept for the next."""

    def __init__(self) -> None:
        self.last: Dict[tuple, Tuple[tuple, Parts]] = {}
        self.now: Dict[tuple, Tuple[tuple, Parts]] = {}

    def next_render(self) -> None:
        self.last, self.now = self.now, {}


class Families:
    """Samples and their lines by family name, in the order they were first added.

    In node mode a mount's series also carry its pod_uid, volume and container_id, a
    cgroup's its pod_uid (catalogue.node_labels): from `labels`, the labels every sample
    added here carries where its family has them, and from a sample's own `extra`.
    """

    def __init__(
        self,
        node_mode: bool = False,
        memo: Optional[Memo] = None,
        labels: Optional[Dict[str, str]] = None,
    ) -> None:
        self.node_mode = node_mode
        self.memo = memo or Memo()
        self.labels = labels or {}
        self.parts: Parts = {}

    def add(
        self,
        name: str,
        labels: Sequence[str],
        value: float,
        extra: Optional[Dict[str, str]] = None,
    ) -> None:
        form = shape(name, self.node_mode)
        if form.added:
            given = {**self.labels, **extra} if extra else self.labels
            labels = (*labels, *[given.get(k, "") for k in form.added])
        parts = self.parts.get(name)
        if parts is None:
            parts = self.parts[name] = ([], [])
        labelset = dict(zip(form.labelnames, labels))
        parts[0].append(Sample(form.sample_name, labelset, value))
        parts[1].append(form.line.format(labels, value))

    def child(self, labels: Optional[Dict[str, str]] = None) -> "Families":
        return Families(self.node_mode, self.memo, labels)

    def part(self, key: tuple, labels: Dict[str, str], make: Callable, *inputs) -> None:
        """Adds what `make(child, *inputs)` adds to a child carrying `labels`, or what it
        added for `key` in the last render when `labels` and `inputs` are equal: `make`
        makes its series from them alone."""
        known = self.memo.last.get(key)
        if known is None or known[0] != (labels, *inputs):
            staged = self.child(labels)
            make(staged, *inputs)
            known = ((labels, *inputs), staged.parts)
        self.memo.now[key] = known
        self.merge(known[1])

    def merge(self, parts: Parts) -> None:
        for name, (samples, lines) in parts.items():
            mine = self.parts.get(name)
            if mine is None:
                self.parts[name] = (samples[:], lines[:])
            else:
                mine[0].extend(samples)
                mine[1].extend(lines)

    def __iter__(self) -> Iterator[Metric]:
        for name, (samples, lines) in self.parts.items():
            form = shape(name, self.node_mode)
            family = form.kind(name, form.help, labels=form.labelnames)
            family.samples = samples
            family.lines = lines  # read by render.encode
            yield family
