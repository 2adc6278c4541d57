"""Metric families from the catalogue, with each sample's line as prometheus_client's text
format writes it (the same line serves OpenMetrics 1.0.0: legacy names, no timestamps), so
a body is the lines joined (render.py). Between two renders most of a node's mounts and
cgroups are as they were: `Families.parts_of` adds again what each added, while its inputs
are equal (`Memo`).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from exporter.model.catalogue import lookup, node_labels

Parts = Dict[str, Tuple[List[Sample], List[str]]]  # family name -> samples, their lines


class Shape:
    """What every sample of one family needs: its kind, help and label names (those node
    mode adds last), and the template of its lines, which takes label values in that order
    and writes them sorted by name, as generate_latest does."""

    def __init__(
        self, sample_name: str, names: Sequence[str], kind=None, doc="", added=()
    ):
        self.sample_name, self.labelnames = sample_name, tuple(names)
        self.kind, self.help, self.added = kind, doc, tuple(added)
        self.order = sorted(range(len(names)), key=names.__getitem__)
        pairs = ",".join(f'{names[i]}="%s"' for i in self.order)
        self.template = sample_name + ("{" + pairs + "}" if names else "") + " %s\n"

    def line(self, values: Sequence[str], value: float) -> str:
        ordered = [escape(values[i]) for i in self.order]
        return self.template % (*ordered, floatToGoString(value))


def escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@functools.lru_cache(maxsize=None)
def shape(name: str, node_mode: bool) -> Shape:
    """The catalogue's family `name`, with the labels node mode adds when in node mode."""
    entry = lookup(name)  # a counter's samples are named as its entry is: *_total
    added = node_labels(entry) if node_mode else ()
    kind = CounterMetricFamily if entry.type == "counter" else GaugeMetricFamily
    return Shape(name, entry.labels + added, kind, entry.help, added)


class Memo:
    """What each part of the last render added, with the inputs it was made from. Only what
    the current render used is kept for the next."""

    def __init__(self) -> None:
        self.last: Dict[tuple, tuple] = {}  # key -> (inputs, Parts)
        self.now: Dict[tuple, tuple] = {}

    def next_render(self) -> None:
        self.last, self.now = self.now, {}


class Families:
    """Samples and their lines by family name, in the order they were first added. The
    labels node mode adds (catalogue.node_labels) come from `labels`, which every sample
    added here carries where its family has them, and from a sample's own `extra`."""

    def __init__(self, node_mode=False, memo: Optional[Memo] = None, labels=None):
        self.node_mode = node_mode
        self.memo = memo or Memo()
        self.labels = labels or {}
        self.parts: Parts = {}

    def add(self, name: str, labels: Sequence[str], value: float, extra=None) -> None:
        form = shape(name, self.node_mode)
        if form.added:
            given = {**self.labels, **extra} if extra else self.labels
            labels = (*labels, *[given.get(k, "") for k in form.added])
        parts = self.parts.setdefault(name, ([], []))
        labelset = dict(zip(form.labelnames, labels))
        parts[0].append(Sample(form.sample_name, labelset, value))
        parts[1].append(form.line(labels, value))

    def parts_of(self, make: Callable, rows: Iterable[tuple]) -> None:
        """For each row (key, labels, *inputs), what `make(child, *inputs)` adds to a child
        carrying `labels`; or what it added for `key` in the last render, when `labels` and
        `inputs` are as they were (`make` makes its series from them alone)."""
        for key, labels, *inputs in rows:
            known = self.memo.last.get(key)
            if known is None or known[0] != (labels, *inputs):
                staged = Families(self.node_mode, self.memo, labels)
                make(staged, *inputs)
                known = ((labels, *inputs), staged.parts)
            self.memo.now[key] = known
            self.merge(known[1])

    def merge(self, parts: Parts) -> None:
        for name, (samples, lines) in parts.items():
            mine = self.parts.setdefault(name, ([], []))
            mine[0].extend(samples)
            mine[1].extend(lines)

    def __iter__(self) -> Iterable[Metric]:
        for name, (samples, lines) in self.parts.items():
            form = shape(name, self.node_mode)
            family = form.kind(name, form.help, labels=form.labelnames)
            family.samples = samples
            family.lines = lines  # read by render.encode
            yield family
