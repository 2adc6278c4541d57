"""Metric families from the catalogue, with each sample's line of the text format.

A line is written as prometheus_client's generate_latest writes it (labels sorted by name,
values escaped, the value by floatToGoString), from one template per family, so a body is
the families' lines joined (bodies.py). The same line serves OpenMetrics 1.0.0 for the
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


def line_template(sample_name: str, names: Sequence[str]) -> str:
    """A str.format template of one sample line whose label values come in `names`' order
    (the catalogue's), written sorted by label name as generate_latest writes them."""
    if not names:
        return sample_name + " {v}\n"
    order = sorted(range(len(names)), key=names.__getitem__)
    inner = ",".join(f'{names[i]}="{{{i}}}"' for i in order)
    return sample_name + "{{" + inner + "}} {v}\n"


def escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def format_line(template: str, values: Sequence[str], value: float) -> str:
    joined = "".join(values)
    if "\\" in joined or "\n" in joined or '"' in joined:  # rare: escape value by value
        values = [escape(v) for v in values]
    return template.format(*values, v=floatToGoString(value))


class Shape(NamedTuple):
    """What every sample of one family needs, looked up once per name and mode."""

    kind: type
    help: str
    labelnames: Tuple[str, ...]
    added: Tuple[str, ...]  # the labels node mode adds
    mount_at: int  # index of the mount label, or -1
    sample_name: str  # a counter's with _total
    template: str


@functools.lru_cache(maxsize=None)
def shape(name: str, node_mode: bool) -> Shape:
    entry = lookup(name)
    added = node_labels(entry) if node_mode else ()
    kind = CounterMetricFamily if entry.type == "counter" else GaugeMetricFamily
    labelnames = tuple(entry.labels) + tuple(added)
    sample_name = kind(name, entry.help).name + (
        "_total" if kind is CounterMetricFamily else ""
    )
    mount_at = entry.labels.index("mount") if "mount" in entry.labels else -1
    template = line_template(sample_name, labelnames)
    return Shape(
        kind, entry.help, labelnames, tuple(added), mount_at, sample_name, template
    )


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
        values = tuple(labels)
        if form.added:
            given = {**self.labels, **extra} if extra else self.labels
            values += tuple(given.get(k, "") for k in form.added)
        samples, lines = self.parts.setdefault(name, ([], []))
        samples.append(
            Sample(form.sample_name, dict(zip(form.labelnames, values)), value)
        )
        lines.append(format_line(form.template, values, value))

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
            family.lines = lines  # read by bodies.encode
            yield family
